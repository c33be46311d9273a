"""Where the wall time of one `mtrl run` goes: the stages' compute against everything else.

    python bench/run_split.py [--out bench/results/run_split.json] [-- MTRL RUN FLAGS ...]

Runs `mtrl run` (the defaults unless flags follow `--`) in a fresh runs directory, in a child
process that is exactly the `mtrl` command (`pipeline.cli.entry()`) with timers wrapped around
its phases, and splits the process's wall time, as the parent measures it, into:

- process_start_s   interpreter start and the CLI's imports (torch, transformers, datasets)
- cli_checks_s      config validation, registry and model checks, tokenizer load
- prefect_start_s   the time the CLI waits for the Prefect API the flows report to (it starts
                    in the background while the CLI checks the config: pipeline.prefect_env)
- stage_compute_s   the stages' own compute: the sum of the manifests' `wall_s` (per stage too)
- store_writes_s    Store.write_dataset outside the stages' compute (Arrow save, digests, fsync)
- artifacts_s       the Prefect artifacts (stage tables, the iteration summary with its plot)
- orchestration_in_flows_s  the rest of the flow runs: flow and task runs, state updates,
                    cached results, the heartbeat, manifest lookups, the base-policy import
- report_s          the learning-curve table and PNG at the end
- shutdown_s        from the CLI's return to the process's exit (stopping the Prefect server,
                    exit hooks)

orchestration_s is everything but stage_compute_s; its share of the wall time is what the
pipeline costs over the same computation in one plain loop. The machine is shared: the JSON
records the load average before and after, and timings taken under load are noisy.
"""

from __future__ import annotations

import time

CHILD_STARTED = time.time()  # before any import: the interpreter's own start is measured by the parent

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    names = ("torch", "transformers", "prefect", "datasets", "trl")
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(), **versions}


# ---------------------------------------------------------------------------------------
# The child: `mtrl run` with timers around its phases
# ---------------------------------------------------------------------------------------


class Timers:
    """Seconds spent in wrapped callables, by name; calls nested in another timed call of the
    same group are not counted twice."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.iterations: list[dict[str, float]] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        setattr(owner, attribute, timed)


def child(args: list[str], out: Path) -> None:
    import pipeline.cli as cli

    imported = time.time()
    import pipeline.prefect_env as prefect_env

    timers = Timers()
    marks: dict[str, float] = {"child_started": CHILD_STARTED, "imported": imported}

    original_start_api = prefect_env.start_api

    def start_api(*a: Any, **k: Any) -> Any:
        """The API starts in the background: prefect_start_s is the time the CLI waits for it."""
        wait = original_start_api(*a, **k)

        def timed_wait() -> Any:
            marks["checks_done"] = time.time()
            own_api = wait()
            marks["prefect_started"] = time.time()
            wrap_flows()
            return own_api

        return timed_wait

    def wrap_flows() -> None:
        import pipeline.flows as flows
        from pipeline.store import Store

        timers.wrap(Store, "write_dataset", "store_writes")
        import pipeline.artifacts as artifacts

        for name in ("publish_stage", "publish_summary", "generation_progress"):
            timers.wrap(flows, name, "artifacts")
        timers.wrap(artifacts, "flush", "artifacts")  # the wait for artifacts sent in the background
        original_iteration = flows.rl_iteration

        def rl_iteration(*a: Any, **k: Any) -> Any:
            before = {name: timers.seconds[name] for name in ("store_writes", "artifacts")}
            started = time.perf_counter()
            result = original_iteration(*a, **k)
            timers.iterations.append(
                {
                    "wall_s": time.perf_counter() - started,
                    **{f"{name}_s": timers.seconds[name] - before[name] for name in before},
                }
            )
            return result

        flows.rl_iteration = rl_iteration  # rl_training looks the name up at call time

        import pipeline.report as report

        write_report = report.write_report

        def timed_report(*a: Any, **k: Any) -> Any:
            marks["flows_done"] = time.time()  # the CLI writes the report right after the flows
            try:
                return write_report(*a, **k)
            finally:
                marks["report_done"] = time.time()

        report.write_report = timed_report  # command_run imports it when the flows are done

    prefect_env.start_api = start_api
    exit_without_teardown = cli.exit_without_teardown

    def timed_exit(status: int) -> Any:
        marks["cli_done"] = time.time()
        out.write_text(
            json.dumps({"status": status, "marks": marks, "seconds": timers.seconds, "iterations": timers.iterations})
        )
        return exit_without_teardown(status)

    cli.exit_without_teardown = timed_exit
    sys.argv = ["mtrl", "run", *args]
    cli.entry()  # exactly the `mtrl` command


# ---------------------------------------------------------------------------------------
# The parent: the process's wall time, split
# ---------------------------------------------------------------------------------------


def stage_compute(runs_dir: Path) -> tuple[dict[str, float], list[float], int]:
    """Sum of manifest wall_s per stage, per iteration; and the generated tokens."""
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
    return dict(per_stage), [per_iteration[i] for i in sorted(per_iteration)], generated


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
    """One `mtrl run` in a child process; its wall time split into phases (module docstring)."""
    timings = runs_dir.parent / f"{runs_dir.name}-timings.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(timings), "--"]
    command += ["--runs-dir", str(runs_dir), *mtrl_args]
    started, ended, stdout = timed_child("mtrl run", command, {**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    child_report = json.loads(timings.read_text())
    marks, seconds = child_report["marks"], child_report["seconds"]
    per_stage, per_iteration, generated = stage_compute(runs_dir)
    compute = sum(per_stage.values())
    wall = ended - started
    flows = marks["flows_done"] - marks["prefect_started"]
    in_flows = flows - compute - seconds.get("store_writes", 0.0) - seconds.get("artifacts", 0.0)
    split = {
        "process_start_s": marks["imported"] - started,
        "cli_checks_s": marks["checks_done"] - marks["imported"],
        "prefect_start_s": marks["prefect_started"] - marks["checks_done"],
        "stage_compute_s": compute,
        "store_writes_s": seconds.get("store_writes", 0.0),
        "artifacts_s": seconds.get("artifacts", 0.0),
        "orchestration_in_flows_s": in_flows,
        "report_s": marks["report_done"] - marks["flows_done"],
        "shutdown_s": ended - marks["cli_done"],
    }
    split["unaccounted_s"] = wall - sum(split.values())  # between the flows' end and the report, prints
    iterations = [
        {
            "wall_s": round(it["wall_s"], 3),
            "stage_compute_s": round(c, 3),
            "orchestration_s": round(it["wall_s"] - c, 3),
            "store_writes_s": round(it["store_writes_s"], 3),
            "artifacts_s": round(it["artifacts_s"], 3),
        }
        for it, c in zip(child_report["iterations"], per_iteration)
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


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        separator = sys.argv.index("--")
        child(sys.argv[separator + 1 :], Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/run_split.json")
    parser.add_argument("mtrl_args", nargs="*", help="flags for `mtrl run` (after --)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-split-"))
    load_before = os.getloadavg()
    result = measure_mtrl(args.mtrl_args, workdir / "runs")
    report = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "command": ["mtrl", "run", *args.mtrl_args],
        "mtrl": result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    shown = {k: v for k, v in result.items() if k not in ("stdout_tail", "per_iteration")}
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    main()
