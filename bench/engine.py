"""Generation and PPO-update speed, in ONE run on the same model and prompts: the notebook
pattern against mtrl's engine, a 50-turn episode turn by turn, a wide batch of rollouts, and
the ppo-update stage at several B x S shapes.

    python bench/engine.py --model tiny --device cpu --out bench/results/engine_cpu.json
    python bench/engine.py --model qwen3-0.6b --device cuda --new-tokens 256 \\
        --ppo-shapes 4x2048,1x8192 --out engine_gpu.json   # random weights, no download
    python bench/engine.py --model smollm2-135m --device cuda --ppo-only --shared-check \\
        --ppo-prompt-tokens 256 --ppo-shapes 32x320g8,32x1024rg8 --ppo-variants default,default+unshared

Sections of the JSON:
- generation: R rollouts x T turns x N new tokens (EOS disabled so every row makes N tokens),
  a fixed observation after each turn. notebook = HF `generate` on the whole left-padded
  history every turn (lockstep batch); engine = stages.generate_rollouts.hf.HFEngine (KV cache kept
  across turns, per-rollout seeded sampling). tokens/s of each and their ratio.
- long_episode: one batch through the engine for --long-turns turns; seconds of every turn,
  and the last turn's time over the first's (does a turn get slower as the context grows?).
- wide: --wide-rollouts rollouts x one turn through the engine: tokens/s.
- ppo_update: the real stage function (stages.ppo_update.train.optimise_policy: old-logprob recompute,
  then forward + backward + AdamW) on B rollouts of S tokens (one turn: a --ppo-prompt-tokens
  prompt, the rest completion; "BxSr" spreads the lengths from S/8 to S; "BxSgG" gives groups of G
  rollouts one prompt, as a group's samples have), padded (one pass of B rows), packed
  (ppo.max_tokens_per_micro_batch = S: first-fit bins of at most S tokens, one pass each) or
  default (the null memory fields, as mtrl picks them for this model size on this device), each
  with "+checkpointed" (activation checkpointing) and "+unshared" (ppo.share_prefix off); the
  passes each ran (ppo-update's manifest counts). Each shape runs in a fresh interpreter
  so its peak memory is its own: CUDA max allocated, or on CPU the process's peak RSS (also
  above the RSS after loading the model). FLOPs = 8 x params x tokens (6 for the trained pass, 2 for the
  recompute) + causal attention, over every rollout's whole stream (a shared prompt counts once
  per rollout: the work a user asks for); MFU against --peak-tflops on CUDA only.
- shared_prefix_check (--shared-check): on the device, in float32, shared-prefix passes against
  unshared ones on 4 groups of 8 rollouts of one prompt (ragged, one with a second turn), padded
  and packed: the largest difference in a logprob, an entropy and a gradient (relative to the
  parameter's largest).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import re
import resource
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from runtime.memory import current_rss_bytes
from runtime.passes import counting_passes
from schemas.config import PPOConfig, RunConfig
from schemas.features import COMPUTE_ADVANTAGES, dataset_from_rows
from stages.generate_rollouts.engine import Request, Sampling
from stages.generate_rollouts.hf import HFEngine
from stages.policy.batching import LARGE_MODEL_PARAMETERS, RolloutSequence, collate, memory_settings
from stages.policy.scoring import forward_targets
from stages.ppo_update import PPOSettings, optimise_policy


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    if name == "tiny":
        from pipeline.models.base_model import EMBEDDED_POLICY
        from stages.policy.loading import load_model

        return load_model(EMBEDDED_POLICY, "float32", device.type)
    torch.manual_seed(0)
    if name == "smollm2-135m":  # SmolLM2-135M-Instruct's shape (bench/real_model.py's model), random weights
        smollm2 = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
        return LlamaForCausalLM(smollm2).to(device=device, dtype=torch.bfloat16).eval()
    config = Qwen3Config(  # Qwen3-0.6B's shape; random weights cost the same per step
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def notebook_pattern(model, prompts, observation, turns, new_tokens, device) -> tuple[int, float]:
    """Re-encode every rollout's whole history each turn with HF generate (left padding)."""
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    histories = [list(p) for p in prompts]
    generated, started = 0, time.perf_counter()
    for _ in range(turns):
        width = max(len(h) for h in histories)
        ids = torch.zeros((len(histories), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, h in enumerate(histories):
            ids[i, width - len(h) :] = torch.tensor(h)
            mask[i, width - len(h) :] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for i, h in enumerate(histories):
            h += out[i, width:].tolist() + observation
        generated += len(histories) * new_tokens
    synchronize(device)
    return generated, time.perf_counter() - started


def engine_turns(model, prompts, observation, turns, new_tokens, device) -> tuple[int, list[float]]:
    """The same workload through the engine (each turn prefills only its new tokens).
    Returns the tokens generated and the seconds of each turn."""
    engine = HFEngine(model, pad_token_id=0, eos_token_ids=[])
    streams = [list(p) for p in prompts]
    generated, seconds = 0, []
    for turn in range(turns):
        started = time.perf_counter()
        requests = [Request(i, s, seed=1000 * turn + i, max_new_tokens=new_tokens) for i, s in enumerate(streams)]
        for i, completion in enumerate(engine.sample(requests, Sampling(temperature=1.0))):
            streams[i] = streams[i] + completion.token_ids + observation
            generated += len(completion.token_ids)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return generated, seconds


def random_tokens(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=generator).tolist() for _ in range(count)]


# ---------------------------------------------------------------------------------------
# PPO update (each shape in its own process)
# ---------------------------------------------------------------------------------------


SHAPE = re.compile(r"(\d+)x(\d+)(r?)(?:g(\d+))?")


def parse_shape(shape: str) -> tuple[int, int, bool, int]:
    """ "BxS[r][gG]": B rollouts of S tokens, r for ragged lengths, gG for groups of G sharing a prompt."""
    match = SHAPE.fullmatch(shape)
    if match is None:
        raise SystemExit(f"--ppo-shapes: {shape!r} is not BxS[r][gG]")
    batch, seq, ragged, group = match.groups()
    return int(batch), int(seq), ragged == "r", int(group or 1)


def synthetic_turns(batch: int, seq: int, vocab: int, ragged: bool, group_size: int = 1, prompt_tokens: int = 64):
    """B one-turn rollouts: a prompt of prompt_tokens and sampled tokens, S tokens in all, or with
    `ragged` lengths spread evenly from S/8 to S (what padding wastes and packing saves); the
    rollouts of a group (group_size of them) share their prompt, as a group of G samples does."""
    lengths = [seq - (seq - seq // 8) * i // max(batch - 1, 1) if ragged else seq for i in range(batch)]
    lengths = [max(n, prompt_tokens + 1) for n in lengths]
    prompts = random_tokens(-(-batch // group_size), prompt_tokens, vocab, 1)
    completion = [random_tokens(1, n - prompt_tokens, vocab, 2 + i)[0] for i, n in enumerate(lengths)]
    rows = []
    for i in range(batch):
        n = len(completion[i])
        rows.append(
            {
                "rollout_id": i,
                "group_id": i // group_size,
                "turn": 0,
                "failed": False,
                "context_token_ids": prompts[i // group_size],
                "completion_token_ids": completion[i],
                "completion_logprobs": [-7.0] * n,
                "observation_token_ids": [],
                "advantages": [1.0 if i % 2 else -1.0] * n,
                "returns": [0.0] * n,
                "values": [],
                "ref_logprobs": [],
            }
        )
    return dataset_from_rows(rows, COMPUTE_ADVANTAGES)


def ppo_measure(
    model_name: str, device_name: str, shape: str, variant: str, peak_tflops: float, prompt_tokens: int
) -> dict:
    """One update's speed and memory. `variant` joins with "+": padded | packed (bins of S tokens) |
    default (the memory settings mtrl picks for this model size on this device, null fields),
    then checkpointed (activation checkpointing) and unshared (ppo.share_prefix off)."""
    device = torch.device(device_name)
    model = build_model(model_name, device)
    batch, seq, ragged, group_size = parse_shape(shape)
    turns = synthetic_turns(batch, seq, model.config.vocab_size, ragged, group_size, prompt_tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        rss_before = current_rss_bytes() / 1e9
    parts = variant.split("+")
    ppo = PPOConfig(
        learning_rate=1e-6,
        minibatch_rollouts=batch,
        micro_batch_rollouts=batch,
        max_tokens_per_micro_batch=None if "default" in parts else seq if "packed" in parts else 0,
        gradient_checkpointing=None if "default" in parts else "checkpointed" in parts,
        share_prefix="unshared" not in parts,
        logprob_chunk_tokens=4096,
        kl_coef=0.0,  # the synthetic rollouts have no reference logprobs: the update's own cost
    )
    settings = PPOSettings.resolve(RunConfig(ppo=ppo, generation={"temperature": 1.0}))
    params = sum(p.numel() for p in model.parameters())
    settings = memory_settings(settings, large=params >= LARGE_MODEL_PARAMETERS, on_gpu=device.type == "cuda")
    times = []
    for repeat in range(3):  # the first run warms up
        synchronize(device)
        started = time.perf_counter()
        with counting_passes() as passes:
            optimise_policy(model, turns, settings=settings, pad_token_id=0, seed=repeat)
        synchronize(device)
        times.append(time.perf_counter() - started)
    seconds = sum(times[1:]) / len(times[1:])
    layers, width = model.config.num_hidden_layers, model.config.num_attention_heads * model.config.head_dim
    lengths = [len(c) + len(p) for c, p in zip(turns["completion_token_ids"], turns["context_token_ids"])]
    tokens = sum(lengths)
    # 2 (matmul) x 2 (QK^T and AV) x S^2/2 (causal) x width per layer per sequence = 2 S^2 width;
    # x 4 for forward + backward (x3) + recompute forward (x1). Useful FLOPs only (no padding).
    flops = 8 * params * tokens + 4 * 2 * layers * width * sum(n * n for n in lengths)
    result = {
        "shape": shape,
        "tokens": tokens,
        "variant": variant,
        "settings": {
            "max_tokens_per_micro_batch": settings.max_tokens_per_micro_batch,
            "gradient_checkpointing": settings.gradient_checkpointing,
            "share_prefix": settings.share_prefix,
        },
        "passes": passes,
        "seconds_per_update": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 1),
        "achieved_tflops": round(flops / seconds / 1e12, 4),
    }
    if device.type == "cuda":
        result["mfu"] = round(flops / seconds / (peak_tflops * 1e12), 4)
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
        result["peak_rss_gb"] = round(peak, 3)
        result["peak_rss_above_loaded_model_gb"] = round(peak - rss_before, 3)
    return result


def shared_prefix_check(model_name: str, device_name: str, prompt_tokens: int) -> dict:
    """Shared-prefix passes against unshared ones on this device, in float32: groups of 8 rollouts
    of one prompt (ragged completions, one with a second turn), padded and packed. Reported: the
    largest difference in a logprob and an entropy, and per parameter the largest gradient
    difference over that parameter's largest gradient (the worst parameter)."""
    device = torch.device(device_name)
    model = build_model(model_name, device).float()
    vocab = model.config.vocab_size
    sequences = []
    for group in range(4):
        prompt = random_tokens(1, prompt_tokens, vocab, 100 + group)[0]
        for member in range(8):
            completion = random_tokens(1, 16 + 24 * member, vocab, 1000 * group + member)[0]
            sequence = RolloutSequence(
                token_ids=prompt + completion,
                target_positions=list(range(prompt_tokens, prompt_tokens + len(completion))),
            )
            if member == 3:  # a second turn: an observation, then a completion
                second = random_tokens(1, 20, vocab, 7)[0]
                sequence.token_ids += random_tokens(1, 12, vocab, 8)[0] + second
                sequence.target_positions += range(len(sequence.token_ids) - len(second), len(sequence.token_ids))
            sequence.advantages = torch.linspace(-1.0, 1.0, len(sequence.target_positions)).tolist()
            sequences.append(sequence)

    def run(packed: bool, share_prefix: bool):
        model.zero_grad()
        batch = collate(sequences, 0, device, packed=packed, share_prefix=share_prefix)
        logprobs, entropy, _ = forward_targets(model, batch, 1.0, 4096)
        ((logprobs + 0.1 * entropy) * batch["advantages"]).sum().backward()
        return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()], int(batch["tokens"])

    logprobs, entropy, grads, tokens = run(packed=False, share_prefix=False)
    result = {"rollouts": len(sequences), "prompt_tokens": prompt_tokens, "unshared_tokens": tokens}
    for packed in (False, True):
        shared_logprobs, shared_entropy, shared_grads, shared_tokens = run(packed, share_prefix=True)
        result["packed" if packed else "padded"] = {
            "computed_tokens": shared_tokens,
            "max_logprob_difference": float((shared_logprobs - logprobs).abs().max()),
            "max_entropy_difference": float((shared_entropy - entropy).abs().max()),
            "max_relative_gradient_difference": max(
                float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))
                for ours, theirs in zip(shared_grads, grads)
            ),
        }
    return result


def in_fresh_process(args: argparse.Namespace, *flags: str) -> dict:
    """Run one measurement in a new interpreter (its peak memory its own; JSON back on stdout)."""
    command = [sys.executable, __file__, "--model", args.model, "--device", args.device]
    command += ["--peak-tflops", str(args.peak_tflops), "--ppo-prompt-tokens", str(args.ppo_prompt_tokens), *flags]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def generation_sections(args: argparse.Namespace, device: torch.device) -> dict:
    """The notebook pattern against the engine, the 50-turn episode and the wide batch."""
    model = build_model(args.model, device)
    vocab = model.config.vocab_size
    prompts = random_tokens(args.rollouts, args.prompt_tokens, vocab, 0)
    observation = random_tokens(1, args.observation_tokens, vocab, 3)[0]

    work = (prompts, observation, args.turns, args.new_tokens, device)
    notebook_tokens, notebook_seconds = notebook_pattern(model, *work)
    engine_tokens, engine_seconds = engine_turns(model, *work)
    notebook_rate, engine_rate = notebook_tokens / notebook_seconds, engine_tokens / sum(engine_seconds)

    long_prompts = prompts[: args.long_rollouts]
    _, turn_seconds = engine_turns(model, long_prompts, observation, args.long_turns, args.long_new_tokens, device)
    wide_prompts = random_tokens(args.wide_rollouts, args.prompt_tokens, vocab, 4)
    wide_tokens, wide_seconds = engine_turns(model, wide_prompts, observation, 1, args.wide_new_tokens, device)
    return {
        "generation": {
            "rollouts": args.rollouts,
            "turns": args.turns,
            "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens,
            "notebook_tokens_per_second": round(notebook_rate, 1),
            "engine_tokens_per_second": round(engine_rate, 1),
            "ratio": round(engine_rate / notebook_rate, 2),
        },
        "long_episode": {
            "rollouts": args.long_rollouts,
            "turns": args.long_turns,
            "new_tokens_per_turn": args.long_new_tokens,
            "turn_seconds": [round(s, 4) for s in turn_seconds],
            "last_over_first": round(turn_seconds[-1] / turn_seconds[0], 2),
        },
        "wide": {
            "rollouts": args.wide_rollouts,
            "new_tokens": args.wide_new_tokens,
            "tokens_per_second": round(wide_tokens / wide_seconds[0], 1),
        },
    }


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2-135m", "qwen3-0.6b"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--observation-tokens", type=int, default=16)
    parser.add_argument("--long-rollouts", type=int, default=8, help="rollouts of the 50-turn episode")
    parser.add_argument("--long-turns", type=int, default=50)
    parser.add_argument("--long-new-tokens", type=int, default=16)
    parser.add_argument("--wide-rollouts", type=int, default=256)
    parser.add_argument("--wide-new-tokens", type=int, default=32)
    parser.add_argument(
        "--ppo-shapes",
        default="4x512,1x2048,8x1024r",
        help="BxS list, a trailing r for ragged lengths (S/8 to S); the tiny model has 4096 positions",
    )
    parser.add_argument(
        "--ppo-variants",
        default="padded,packed,padded+checkpointed",
        help="padded | packed | default (mtrl's memory settings for the model and device), each + checkpointed, + unshared",
    )
    parser.add_argument("--ppo-prompt-tokens", type=int, default=64, help="prompt tokens of each synthetic rollout")
    parser.add_argument("--ppo-only", action="store_true", help="skip the generation sections")
    parser.add_argument("--shared-check", action="store_true", help="shared-prefix passes against unshared (fp32)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 peak of the GPU")
    parser.add_argument("--ppo-one", help=argparse.SUPPRESS)  # BxS:variant, in a fresh process
    parser.add_argument("--shared-check-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.ppo_one:
        shape, variant = args.ppo_one.split(":")
        print(
            json.dumps(ppo_measure(args.model, args.device, shape, variant, args.peak_tflops, args.ppo_prompt_tokens))
        )
        return
    if args.shared_check_one:
        print(json.dumps(shared_prefix_check(args.model, args.device, args.ppo_prompt_tokens)))
        return
    device = torch.device(args.device)
    report: dict = {
        "benchmark": "engine",
        "command": "python bench/engine.py "
        + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items()
            if k not in ("out", "ppo_one", "shared_check_one") and v is not False
        ),
    }
    if not args.ppo_only:
        report |= generation_sections(args, device)
    if args.shared_check:
        report["shared_prefix_check"] = in_fresh_process(args, "--shared-check-one")
        print(json.dumps(report["shared_prefix_check"]))
    report["ppo_update"] = []
    for shape in args.ppo_shapes.lower().split(","):
        for variant in args.ppo_variants.split(","):
            report["ppo_update"].append(in_fresh_process(args, "--ppo-one", f"{shape}:{variant}"))
            print(json.dumps(report["ppo_update"][-1]))
    report |= {
        "machine": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_count": multiprocessing.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "versions": {n: metadata.version(n) for n in ("torch", "transformers")} | {"python": platform.python_version()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
