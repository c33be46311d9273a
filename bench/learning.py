"""Does the default configuration learn, and at what cost? The measurements behind the README's
learning curves.

    python bench/learning.py [--seeds 0 1 2] [--out bench/results/learning_cpu.json]

For each seed, in a fresh runs directory, exactly what a user types:
- `mtrl run --seed S` (the calculator demo, 10 iterations of 64 rollouts): the success rate of
  each iteration, the first against the mean of the last two; the command's wall time; the
  peak memory of ppo-update (the largest `memory.peak_rss_mb` over its manifests: the resident
  set sampled while it trained) and the resident set when it started;
- `mtrl run --task guess-number --seed S`, then `mtrl eval` of the starting policy and of the
  last policy on the same 128 fixed games (`--seed 0` for every evaluation: the same secrets
  and sampling seeds): success, mean turns when solved, and turns to solve with an unsolved
  game counted at the 50-turn limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import machine

MTRL = [sys.executable, "-m", "pipeline.cli"]
EVAL_GAMES = ["--task", "guess-number", "--rollouts", "128", "--group-size", "1", "--seed", "0"]
# Why a game ends: solved or given up (natural_termination), cut at max_new_tokens (truncation),
# or the 50-turn limit (max_turns_reached).
EVAL_KEYS = (
    "success_rate",
    "mean_turns_to_solve",
    "mean_turns_to_solve_or_limit",
    "mean_turns",
    "natural_termination_rate",
    "truncation_rate",
    "max_turns_reached_rate",
)


def mtrl(*args: str) -> tuple[str, float]:
    """Run the CLI; its stdout and wall time."""
    env = {**os.environ, "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([*MTRL, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:  # say why: a bench's traceback alone hides the command's own error
        raise SystemExit(f"mtrl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout, time.perf_counter() - started


def evaluate(runs_dir: Path, policy: str | None) -> dict:
    out, _ = mtrl("eval", *EVAL_GAMES, "--runs-dir", str(runs_dir), *(["--policy", policy] if policy else []))
    metrics = json.loads(out[out.index("{") :])
    return {key: metrics[key] for key in EVAL_KEYS}


def training_run(runs_dir: Path, *flags: str) -> dict:
    """One `mtrl run`: its learning curve (from the manifests), wall time and ppo-update memory."""
    from pipeline.monitoring.report import iterations
    from pipeline.store.lineage import latest_policy
    from pipeline.store.versions import Store

    _, wall = mtrl("run", "--runs-dir", str(runs_dir), *flags)
    store = Store(runs_dir)
    rows = iterations(store)
    updates = store.versions("ppo-update")
    success = [round(row["success_rate"], 4) for row in rows]
    return {
        "wall_s": round(wall, 1),
        "success_rate": success,
        "first": success[0],
        "last_two_mean": round((success[-2] + success[-1]) / 2, 4),
        "mean_turns_to_solve": [row.get("mean_turns_to_solve") for row in rows],
        "mean_turns_to_solve_or_limit": [row.get("mean_turns_to_solve_or_limit") for row in rows],
        "ppo_update_peak_rss_mb": max(m.extra("memory")["peak_rss_mb"] for m in updates),
        "ppo_update_rss_before_mb": max(m.extra("memory")["rss_before_mb"] for m in updates),
        "ppo_update_wall_s": round(sum(m.wall_s for m in updates), 1),
        "final_policy": latest_policy(store),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench/results/learning_cpu.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-learning-"))
    results: dict = {"machine": machine(), "calculator": [], "guess_number": {"runs": []}}
    for seed in args.seeds:
        run = training_run(workdir / f"calculator-{seed}", "--seed", str(seed))
        results["calculator"].append({"seed": seed, **run})
        print(json.dumps(results["calculator"][-1]), flush=True)
    results["guess_number"]["starting_policy"] = evaluate(workdir / "eval", None)
    print(json.dumps(results["guess_number"]["starting_policy"]), flush=True)
    for seed in args.seeds:
        runs_dir = workdir / f"guess-number-{seed}"
        run = training_run(runs_dir, "--task", "guess-number", "--seed", str(seed))
        run["final_policy_eval"] = evaluate(runs_dir, run["final_policy"])
        results["guess_number"]["runs"].append({"seed": seed, **run})
        print(json.dumps(results["guess_number"]["runs"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
