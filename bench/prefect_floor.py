"""The fixed costs of a default `mtrl run` that no cut inside mtrl removes: the imports, and what
Prefect charges per flow run and per task run on the API mtrl uses.

    python bench/prefect_floor.py [--repeats 40] [--out bench/results/prefect_floor.json]

Measured in the conditions of `mtrl run`: its temporary Prefect server (pipeline.prefect_env,
with its database template and SQLite settings), flow heartbeats off as inside an rl-training
run, one process on an otherwise idle machine:

- import_s          `import torch / transformers / datasets / prefect`, each in a fresh
                    interpreter, and the four together (median of 3 fresh interpreters each)
- request_ms        one API call from Prefect's sync client: read a flow run, create one, set
                    its state Running, then Completed (median of `repeats`)
- new_client_ms     constructing a Prefect API client (Prefect builds a TLS context from the CA
                    bundle for each one, even for an http:// API; it makes one per subflow, for
                    the subflow's tracking task run)
- subflow_s         one rl-iteration-like subflow (a flow called inside a flow, with one task)
- task_run_s        one task run inside a flow, persisting its JSON result and keyed by a
                    cache key as mtrl's stage tasks are
- server_stop_s     SIGTERM to the server's exit, after the runs above

`floor_s` multiplies them by what a default run does (10 iterations: 10 subflows, ~110 stage
task runs, 10 of them counted in the subflows) and adds the imports and the server's stop: a
lower bound of its orchestration with the pipeline as it is.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_split import REPO, machine  # noqa: E402

DEFAULT_ITERATIONS, DEFAULT_TASK_RUNS = 10, 110  # a default run: 10 iterations of ~11 stage task runs


def import_seconds(modules: str) -> float:
    """Median over 3 fresh interpreters of the time to import `modules` (comma-separated)."""
    code = f"import time; started = time.perf_counter(); import {modules}; print(time.perf_counter() - started)"
    times = [float(subprocess.check_output([sys.executable, "-c", code], cwd=REPO)) for _ in range(3)]
    return statistics.median(times)


def median_of(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prefect_costs(repeats: int) -> dict[str, Any]:
    from pipeline import prefect_env

    runs_dir = Path(tempfile.mkdtemp(prefix="mtrl-floor-")) / "runs"
    prefect_env.start_api(runs_dir, "thread")()  # mtrl's temporary server, as `mtrl run` starts it
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
        with prefect_env.flow_heartbeats(enabled=False):
            counter = iter(range(10**6))
            subflow = median_of(lambda: iteration(next(counter)), repeats)
            task_run = median_of(lambda: stage(next(counter)), repeats * 3)
        return {"subflow_s": subflow, "task_run_s": task_run}

    with prefect_env.flow_heartbeats(enabled=False):
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
    server = next(pid for pid, command in _children() if "prefect.server.api.server:create_app" in command)
    stopped = time.perf_counter()
    os.kill(server, signal.SIGTERM)
    os.waitpid(server, 0)  # this process's child (started by prefect_env's thread): reaped at its exit
    return {
        **runs,
        "request_ms": {name: round(1000 * seconds, 1) for name, seconds in request_ms.items()},
        "new_client_ms": round(1000 * new_client, 1),
        "server_stop_s": time.perf_counter() - stopped,
    }


def _children() -> list[tuple[int, str]]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/prefect_floor.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    imports = {name: import_seconds(name) for name in ("torch", "transformers", "datasets", "prefect")}
    imports["all four"] = import_seconds("torch, transformers, datasets, prefect")
    costs = prefect_costs(args.repeats)
    floor = {
        "imports_s": imports["all four"],
        "subflows_s": DEFAULT_ITERATIONS * costs["subflow_s"],
        "task_runs_s": (DEFAULT_TASK_RUNS - DEFAULT_ITERATIONS) * costs["task_run_s"],
        "server_stop_s": costs["server_stop_s"],
    }
    floor["total_s"] = sum(floor.values())
    report = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "repeats": args.repeats,
        "import_s": {name: round(value, 3) for name, value in imports.items()},
        **{name: round(value, 4) if isinstance(value, float) else value for name, value in costs.items()},
        "floor_s": {name: round(value, 3) for name, value in floor.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
