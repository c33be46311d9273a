"""What the Prefect layer costs per RL iteration, and the Ray runner's time against the thread runner.

    python bench/orchestration.py [--iterations 3] [--rollouts 32] [--max-turns 4]
                                  [--out bench/results/orchestration.json]

Against one real `prefect server start` on 127.0.0.1 (started here), for each runner:
- `iteration_s`: wall time of each rl-iteration flow run (flow heartbeats on, as in production);
- `stage_compute_s`: the sum of the stages' own compute time (manifest `wall_s`), the work a
  plain-Python loop would do too;
- `remainder_s` = iteration_s - stage_compute_s: Prefect (flow and task runs, state updates,
  cached results, artifacts) plus the store (writing and loading Arrow datasets, digests).
The Prefect share is measured separately on the same server: the cost of one trivial task run
and of one trivial flow run, multiplied by the task and flow runs of an iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path


def machine() -> dict:
    versions = {name: metadata.version(name) for name in ("prefect", "prefect-ray", "ray", "torch", "datasets")}
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(), **versions}


def prefect_unit_costs(repeats: int = 40) -> dict:
    from prefect import flow, task

    @task(persist_result=False)
    def nothing(i: int) -> int:
        return i

    @flow(persist_result=False)
    def tasks_only(n: int) -> float:
        started = time.perf_counter()
        for i in range(n):
            nothing(i)
        return (time.perf_counter() - started) / n

    @flow(persist_result=False)
    def empty() -> None:
        return None

    per_task = tasks_only(repeats)
    flow_times = []
    for _ in range(5):
        started = time.perf_counter()
        empty()
        flow_times.append(time.perf_counter() - started)
    return {"task_run_s": per_task, "flow_run_s": statistics.median(flow_times)}


def run(runner: str, args: argparse.Namespace, workdir: Path) -> dict:
    """runner: `thread`, or `ray:N` for the ray runner with execute-tools split over N Ray tasks."""
    from pipeline.flows import import_base_policy, rl_iteration
    from pipeline.runners import stage_runner
    from pipeline.stage_table import POLICY
    from pipeline.store import Store
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=args.iterations,
        task={"name": args.task, "rollouts": args.rollouts, "group_size": args.group_size, "max_turns": args.max_turns},
        runner={"kind": runner.split(":")[0], "shards": int(runner.split(":")[1]) if ":" in runner else 1},
        store={"runs_dir": workdir / runner.replace(":", "-")},
    )
    store = Store(config.store.runs_dir)
    policy = import_base_policy(store, config)
    iterations = []
    started = time.perf_counter()
    with stage_runner(config.runner):
        runner_start_s = time.perf_counter() - started
        for iteration in range(config.iterations):
            began = time.perf_counter()
            result = rl_iteration(config, iteration=iteration, policy_version=policy)
            wall = time.perf_counter() - began
            policy = result["next_policy"]
            # every stage version of the iteration: the part of its lineage that has this iteration
            lineage = store.lineage("ppo-update", result["versions"]["ppo-update"])
            stages = [m for m in lineage if m.stage != POLICY and m.iteration == iteration]
            compute = sum(m.wall_s for m in stages)
            iterations.append(
                {
                    "iteration_s": round(wall, 2),
                    "stage_compute_s": round(compute, 2),
                    "remainder_s": round(wall - compute, 2),
                    "task_runs": len(stages),
                    "reward_mean": result["metrics"]["reward_mean"],
                }
            )
            print(runner, iterations[-1], flush=True)
    return {
        "runner_start_s": round(runner_start_s, 2),
        "total_s": round(time.perf_counter() - started, 2),
        "iterations": iterations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--task", default="calculator,weather")
    parser.add_argument("--runners", default="thread,ray:1,ray:4")
    parser.add_argument("--out", type=Path, default=Path("bench/results/orchestration.json"))
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="mtrl-bench-"))
    from pipeline import prefect_env

    os.environ.pop("PREFECT_API_URL", None)
    prefect_env.configure_api(workdir, "ray")  # a real local server, stopped at exit
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    units = prefect_unit_costs()
    results = {runner: run(runner, args, workdir) for runner in args.runners.split(",")}

    for result in results.values():
        steady = result["iterations"][1:] or result["iterations"]  # the first one pays model loads
        wall = statistics.mean(i["iteration_s"] for i in steady)
        prefect_s = statistics.mean(i["task_runs"] for i in steady) * units["task_run_s"] + units["flow_run_s"]
        result["steady_state"] = {
            "iteration_s": round(wall, 2),
            "remainder_s": round(statistics.mean(i["remainder_s"] for i in steady), 2),
            "remainder_pct": round(100 * statistics.mean(i["remainder_s"] for i in steady) / wall, 1),
            "prefect_estimate_s": round(prefect_s, 2),
            "prefect_estimate_pct": round(100 * prefect_s / wall, 1),
        }
    report = {
        "machine": machine(),
        "workload": vars(args) | {"out": str(args.out)},
        "prefect_unit_costs": units,
        "runners": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v["steady_state"] | {"total_s": v["total_s"]} for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
