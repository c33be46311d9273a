"""`--runner ray` runs execute-tools and assign-rewards as Ray tasks (real local Ray, real
Prefect server started by mtrl) and writes exactly the versions of `--runner thread` (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.store.versions import Store

pytestmark = pytest.mark.slow
ARGS = ["--iterations", "1", "--task", "calculator,weather", "--rollouts", "8", "--group-size", "4", "--max-turns", "3"]


def mtrl_run(runs_dir: Path, runner: str, env: dict) -> str:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), "--runner", runner, *ARGS]
    command += ["--set", "runner.shards=3"]  # execute-tools rows split over 3 Ray tasks (ignored by threads)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stderr


def test_ray_runner_writes_the_versions_of_the_thread_runner(tmp_path, prefect_server_env):
    mtrl_run(tmp_path / "thread", "thread", prefect_server_env)
    without_api = {k: v for k, v in prefect_server_env.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    log = mtrl_run(tmp_path / "ray", "ray", without_api)
    assert "started a Prefect server for the Ray workers at http://127.0.0.1:" in log

    threaded, distributed = Store(tmp_path / "thread"), Store(tmp_path / "ray")
    expected = {f"{m.stage}/{m.version}": m.files for m in threaded.versions()}
    assert {f"{m.stage}/{m.version}": m.files for m in distributed.versions()} == expected

    def processes(store: Store, stage: str) -> set[int]:
        return {m.extra("process")["pid"] for m in store.versions(stage)}

    (driver,) = processes(distributed, "generate-rollouts")  # generation stays with the model
    assert driver not in processes(distributed, "execute-tools") | processes(distributed, "assign-rewards")
    assert processes(threaded, "execute-tools") == processes(threaded, "generate-rollouts")


def test_the_ray_runner_refuses_to_start_without_a_prefect_api():
    """Without an API each Ray worker would start its own temporary server: a clear error instead."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.orchestration.runners import stage_runner
    from runtime.ray import RunnerError
    from schemas.config import RunnerConfig

    with temporary_settings(restore_defaults={PREFECT_API_URL}), pytest.raises(RunnerError, match="Prefect server"):
        with stage_runner(RunnerConfig(kind="ray")):
            pass


def _tag_with_pid(rows):
    return rows.map(lambda row: {"pid": os.getpid()})


def test_row_shards_run_as_ray_tasks_and_come_back_in_order(monkeypatch):
    from runtime.ray import RAY_ENVIRONMENT, map_row_shards

    for name, value in RAY_ENVIRONMENT.items():  # before Ray is imported: it reads them then
        monkeypatch.setenv(name, value)
    import datasets
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module

    @ray.remote
    def stage() -> tuple[int, list[int], list[int], str]:
        rows = datasets.Dataset.from_dict({"x": list(range(10))})
        out = map_row_shards(_tag_with_pid, rows, "ray", 4)
        return os.getpid(), out["x"], out["pid"], ray.util.get_node_ip_address()

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        stage_pid, order, pids, address = ray.get(stage.remote())
    finally:
        ray.shutdown()
    assert address == "127.0.0.1"  # kept on loopback
    assert order == list(range(10))
    assert stage_pid not in pids and len(set(pids)) >= 2  # other workers did the rows


def test_row_shards_of_the_ray_runner_outside_ray_are_an_error_not_a_silent_in_process_run():
    import datasets

    from runtime.ray import RunnerError, map_row_shards

    rows = datasets.Dataset.from_dict({"x": list(range(4))})
    for shards in (1, 2):
        with pytest.raises(RunnerError, match="not connected to Ray"):
            map_row_shards(_tag_with_pid, rows, "ray", shards)
    assert map_row_shards(_tag_with_pid, rows, "thread", 2)["pid"] == [os.getpid()] * 4
