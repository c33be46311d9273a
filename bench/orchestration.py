"""What the pipeline costs beyond the stages' own compute: Prefect, the store, the process.

    python bench/orchestration.py split   [--out bench/results/orchestration_split.json] [-- MTRL RUN FLAGS ...]
    python bench/orchestration.py floor   [--repeats 40] [--out bench/results/orchestration_floor.json]
    python bench/orchestration.py runners [--runners thread,ray:1,ray:4] [--out bench/results/orchestration_runners.json]

split: one `mtrl run` (the defaults unless flags follow --), the command itself in a fresh
runs directory, timed from launch to exit; its wall time split with what the run recorded
(its run log, RUNS_DIR/logs/run-*.json: runtime/phases.py) and its manifests:
- process_start_s   launch to the CLI module imported (interpreter, pydantic, the config)
- cli_checks_s      config validation, registry and model checks, torch & co. imported
- prefect_start_s   waiting for the Prefect API (it starts in the background meanwhile)
- stage_compute_s   the stages' own compute: the sum of the manifests' `wall_s` (per stage too)
- store_writes_s    writing the datasets (Arrow, digests, fsync, rename) outside the compute
- artifacts_s       the Prefect artifacts' share of the flows (the plot, queueing, the final wait)
- orchestration_in_flows_s  the rest of the flows: flow and task runs, states, cached results,
                    lineage lookups, the base-policy import
- report_s          the learning-curve table and PNG at the end
- shutdown_s        the report's end to the process's exit (prints, the run log, the exit hooks,
                    stopping the Prefect server)
orchestration_s is everything but stage_compute_s: what the pipeline costs over the same
computation in one plain loop.

floor: the fixed costs no cut inside mtrl removes, in `mtrl run`'s conditions (its temporary
Prefect server with its database template and SQLite settings, heartbeats off): the imports
(median of 3 fresh interpreters), one API call of each kind, a new API client, one subflow with
one task, one task run with a JSON result, the server's stop; `floor_s` multiplies them by what a
default run does (10 subflows, ~110 task runs) and adds the imports and the stop.

runners: rl-iteration flows called directly (as a deployment runs them, heartbeats on) against
one real `prefect server start`, per runner (`thread`, or `ray:N`: the ray runner with
execute-tools split over N Ray tasks): each iteration's wall time, its stages' compute, the
remainder, and an estimate of Prefect's share from one trivial task run and flow run.

The machine is shared: each JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from provenance import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def median_of(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


# ---------------------------------------------------------------------------------------
# split: one `mtrl run`, its wall time split
# ---------------------------------------------------------------------------------------


def stage_compute(runs_dir: Path) -> tuple[dict[str, float], dict[int, float], int]:
    """Sum of the manifests' wall_s per stage and per iteration; the generated tokens."""
    per_stage: dict[str, float] = defaultdict(float)
    per_iteration: dict[int, float] = defaultdict(float)
    generated = 0
    for manifest_path in runs_dir.glob("*/*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        if manifest["stage"] == "policy":
            continue
        per_stage[manifest["stage"]] += manifest["wall_s"]
        per_iteration[manifest["iteration"]] += manifest["wall_s"]
        if manifest["stage"] == "generate-rollouts":
            generated += manifest["tokens"].get("completion", 0)
    return dict(per_stage), dict(per_iteration), generated


def success_curve(runs_dir: Path) -> list[float]:
    rewarded = [json.loads(p.read_text()) for p in runs_dir.glob("assign-rewards/*/manifest.json")]
    return [m["metrics"]["success_rate"] for m in sorted(rewarded, key=lambda m: m["iteration"])]


def timed_child(name: str, command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run a child process in the repository; its start and end (wall clock) and its stdout. A
    failure raises with the end of its output."""
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return started, ended, done.stdout


def measure_mtrl(mtrl_args: list[str], runs_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `mtrl run` (this environment's `mtrl` command) in a fresh runs dir; its wall time split."""
    command = [str(Path(sys.executable).with_name("mtrl")), "run", "--runs-dir", str(runs_dir), *mtrl_args]
    started, ended, stdout = timed_child("mtrl run", command, {**os.environ, **(env or {})})
    (log,) = runs_dir.glob("logs/run-*.json")
    phases = json.loads(log.read_text())["phases"]
    marks, seconds = phases["marks"], phases["seconds"]
    per_stage, per_iteration, generated = stage_compute(runs_dir)
    compute = sum(per_stage.values())
    wall = ended - started
    store_writes, artifacts = seconds.get("store_writes", 0.0), seconds.get("artifacts", 0.0)
    split = {
        "process_start_s": marks["cli_imported"] - started,
        "cli_checks_s": marks["checks_done"] - marks["cli_imported"],
        "prefect_start_s": marks["api_ready"] - marks["checks_done"],
        "stage_compute_s": compute,
        "store_writes_s": store_writes,
        "artifacts_s": artifacts,
        "orchestration_in_flows_s": marks["flows_done"] - marks["api_ready"] - compute - store_writes - artifacts,
        "report_s": marks["report_done"] - marks["flows_done"],
        "shutdown_s": ended - marks["report_done"],
    }
    iterations = [  # inside each rl-iteration flow function (its flow run's own start and end aside)
        {
            "wall_s": run["wall_s"],
            "stage_compute_s": round(per_iteration[i], 3),
            "store_writes_s": run.get("store_writes_s", 0.0),
            "artifacts_s": run.get("artifacts_s", 0.0),
            "rest_s": round(run["wall_s"] - per_iteration[i] - run.get("store_writes_s", 0.0), 3),
        }
        for i, run in enumerate(phases["sections"].get("iteration", []))
    ]
    orchestration = wall - compute
    return {
        "wall_s": round(wall, 2),
        "split_s": {name: round(value, 3) for name, value in split.items()},
        "stage_compute_by_stage_s": {name: round(value, 3) for name, value in sorted(per_stage.items())},
        "orchestration_s": round(orchestration, 2),
        "orchestration_pct": round(100 * orchestration / wall, 1),
        "per_iteration": iterations,
        "generated_tokens": generated,
        "success_curve": success_curve(runs_dir),
        "stdout_tail": stdout[-1500:],
    }


def split(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-split-"))
    result = measure_mtrl(args.mtrl_args, workdir / "runs")
    shown = {k: v for k, v in result.items() if k not in ("stdout_tail", "per_iteration")}
    print(json.dumps(shown, indent=2))
    return {"command": ["mtrl", "run", *args.mtrl_args], "mtrl": result}


# ---------------------------------------------------------------------------------------
# floor: the fixed costs
# ---------------------------------------------------------------------------------------

DEFAULT_ITERATIONS, DEFAULT_TASK_RUNS = 10, 110  # a default run: 10 iterations of ~11 stage task runs


def import_seconds(modules: str) -> float:
    """Median over 3 fresh interpreters of the time to import `modules` (comma-separated)."""
    code = f"import time; started = time.perf_counter(); import {modules}; print(time.perf_counter() - started)"
    times = [float(subprocess.check_output([sys.executable, "-c", code], cwd=REPO)) for _ in range(3)]
    return statistics.median(times)


def prefect_costs(repeats: int) -> dict[str, Any]:
    from pipeline.prefect_plumbing import servers as prefect_servers
    from pipeline.prefect_plumbing.settings import flow_heartbeats

    runs_dir = Path(tempfile.mkdtemp(prefix="mtrl-floor-")) / "runs"
    prefect_servers.start_api(runs_dir, "thread")()  # mtrl's temporary server, as `mtrl run` starts it
    from prefect import flow, task
    from prefect.client.orchestration import PrefectClient, get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Completed, Pending, Running

    @task(cache_key_fn=lambda context, parameters: f"floor/{parameters['i']}", result_serializer="json")
    def stage(i: int) -> int:
        return i

    @flow(name="floor-iteration")
    def iteration(i: int) -> int:
        return stage(i)

    @flow(name="floor-training")
    def training() -> dict[str, float]:
        with flow_heartbeats(enabled=False):
            counter = iter(range(10**6))
            subflow = median_of(lambda: iteration(next(counter)), repeats)
            task_run = median_of(lambda: stage(next(counter)), repeats * 3)
        return {"subflow_s": subflow, "task_run_s": task_run}

    with flow_heartbeats(enabled=False):
        runs = training()
    with get_client(sync_client=True) as client:
        created = [client.create_flow_run(iteration, parameters={}, state=Pending()) for _ in range(repeats)]
        states = iter(created * 2)
        request_ms = {
            "read_flow_run": median_of(lambda: client.read_flow_run(created[0].id), repeats),
            "create_flow_run": median_of(lambda: client.create_flow_run(iteration, parameters={}), repeats),
            "set_state_running": median_of(lambda: client.set_flow_run_state(next(states).id, Running()), repeats),
            "set_state_completed": median_of(lambda: client.set_flow_run_state(next(states).id, Completed()), repeats),
        }
    url = PREFECT_API_URL.value()
    new_client = median_of(lambda: PrefectClient(url), repeats)
    server = next(pid for pid, command in children() if "prefect.server.api.server:create_app" in command)
    stopped = time.perf_counter()
    os.kill(server, signal.SIGTERM)
    os.waitpid(server, 0)  # this process's child (started by prefect_servers' thread): reaped at its exit
    return {
        **runs,
        "request_ms": {name: round(1000 * seconds, 1) for name, seconds in request_ms.items()},
        "new_client_ms": round(1000 * new_client, 1),
        "server_stop_s": time.perf_counter() - stopped,
    }


def children() -> list[tuple[int, str]]:
    found = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(path.read_text().rsplit(")", 1)[1].split()[1])
            command = (path.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid():
            found.append((int(path.parent.name), command))
    return found


def floor(args: argparse.Namespace) -> dict[str, Any]:
    imports = {name: import_seconds(name) for name in ("torch", "transformers", "datasets", "prefect")}
    imports["all four"] = import_seconds("torch, transformers, datasets, prefect")
    costs = prefect_costs(args.repeats)
    floor_s = {
        "imports_s": imports["all four"],
        "subflows_s": DEFAULT_ITERATIONS * costs["subflow_s"],
        "task_runs_s": (DEFAULT_TASK_RUNS - DEFAULT_ITERATIONS) * costs["task_run_s"],
        "server_stop_s": costs["server_stop_s"],
    }
    floor_s["total_s"] = sum(floor_s.values())
    report = {
        "repeats": args.repeats,
        "import_s": {name: round(value, 3) for name, value in imports.items()},
        **{name: round(value, 4) if isinstance(value, float) else value for name, value in costs.items()},
        "floor_s": {name: round(value, 3) for name, value in floor_s.items()},
    }
    print(json.dumps(report, indent=2))
    return report


# ---------------------------------------------------------------------------------------
# runners: steady-state iterations, thread against Ray
# ---------------------------------------------------------------------------------------


def prefect_unit_costs(repeats: int = 40) -> dict[str, float]:
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

    return {"task_run_s": tasks_only(repeats), "flow_run_s": median_of(empty, 5)}


def run_iterations(runner: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """runner: `thread`, or `ray:N` for the ray runner with execute-tools split over N Ray tasks."""
    from pipeline.models.base_model import import_base_policy
    from pipeline.orchestration.flows import rl_iteration
    from pipeline.orchestration.runners import stage_runner
    from pipeline.orchestration.stage_table import POLICY
    from pipeline.store.versions import Store
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


def runners(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-bench-"))
    from pipeline.prefect_plumbing import servers as prefect_servers

    os.environ.pop("PREFECT_API_URL", None)
    prefect_servers.start_api(workdir, "ray")()  # a real local server, stopped at exit
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    units = prefect_unit_costs()
    results = {runner: run_iterations(runner, args, workdir) for runner in args.runners.split(",")}
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
    print(json.dumps({k: v["steady_state"] | {"total_s": v["total_s"]} for k, v in results.items()}, indent=2))
    workload = {
        k: v for k, v in vars(args).items() if k in ("iterations", "rollouts", "group_size", "max_turns", "task")
    }
    return {"workload": workload, "prefect_unit_costs": units, "runners": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    one = modes.add_parser("split", help="one `mtrl run`, its wall time split")
    one.add_argument("--out", type=Path, default=RESULTS / "orchestration_split.json")
    one.add_argument("mtrl_args", nargs="*", help="flags for `mtrl run` (after --)")
    one.set_defaults(measure=split)
    fixed = modes.add_parser("floor", help="the fixed costs: imports, API calls, subflows, task runs")
    fixed.add_argument("--repeats", type=int, default=40)
    fixed.add_argument("--out", type=Path, default=RESULTS / "orchestration_floor.json")
    fixed.set_defaults(measure=floor)
    each = modes.add_parser("runners", help="steady-state iterations with the thread and the Ray runner")
    each.add_argument("--iterations", type=int, default=3)
    each.add_argument("--rollouts", type=int, default=32)
    each.add_argument("--group-size", type=int, default=8)
    each.add_argument("--max-turns", type=int, default=4)
    each.add_argument("--task", default="calculator,weather")
    each.add_argument("--runners", default="thread,ray:1,ray:4")
    each.add_argument("--out", type=Path, default=RESULTS / "orchestration_runners.json")
    each.set_defaults(measure=runners)
    args = parser.parse_args()
    load_before = os.getloadavg()
    report = args.measure(args)
    loads = {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    write(args.out, {"machine": machine(), "mode": args.mode, **loads, **report})
    print(f"written: {args.out} ({loads})")


if __name__ == "__main__":
    main()
