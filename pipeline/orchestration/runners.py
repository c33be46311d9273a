"""Where execute-tools and assign-rewards run (`runner.kind`).

- `thread`: in the flow's own process (tool calls still run in killable worker processes).
- `ray`: as Ray tasks through prefect-ray, on an in-process local Ray kept on 127.0.0.1, or on
  the cluster at `runner.ray_address`; execute-tools further splits its rows over
  `runner.shards` Ray tasks (tool calls are independent per row); without Ray to run on, an
  error (RunnerError), never a quiet run in this process. Generation and training stay in the
  process that holds the model (training on several nodes, ppo.nodes > 1, runs its own torchrun
  job on the cluster at `runner.ray_address`: runtime/launch.py). The runner changes where
  a stage runs, never its version or its bytes.

Which stages may run on Ray is the stage table's `distributed` (pipeline/orchestration/stage_table.py).

Ray workers are separate processes: without a Prefect server to talk to, each one would start
its own temporary server and its task runs would land there, so
the ray runner requires PREFECT_API_URL (`mtrl run` starts a local server when it is unset).
On a cluster, the runs directory must be on a filesystem every node sees, and the API URL
must be reachable from the nodes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from runtime.ray import RunnerError, import_ray, worker_environment
from schemas.config import RunnerConfig


def prefect_api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


@contextlib.contextmanager
def stage_runner(config: RunnerConfig) -> Iterator[Any | None]:
    """The task runner for the distributed stages: None (run in this process) or a started
    RayTaskRunner, shut down on exit if it started Ray itself."""
    if config.kind == "thread":
        yield None
        return
    api_url = prefect_api_url()
    if not api_url:
        raise RunnerError(
            "runner 'ray' needs a Prefect server that the Ray workers can reach: start one with "
            "`prefect server start --host 127.0.0.1` and export PREFECT_API_URL=http://127.0.0.1:4200/api "
            "(`mtrl run --runner ray` does this itself when PREFECT_API_URL is unset)"
        )
    ray = import_ray("runner 'ray'")
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise RunnerError("runner 'ray' needs the ray extra: pip install 'mtrl[ray]'") from None

    temp_dir = None
    if ray.is_initialized():  # e.g. rl-training's Ray, reused by each rl-iteration
        runner = RayTaskRunner()
    elif config.ray_address:  # the cluster's workers do not inherit this process's environment (the
        # flow's pre-flight checks found the cluster answering at the address)
        workers_environment = {"env_vars": {"PREFECT_API_URL": api_url, **worker_environment()}}
        runner = RayTaskRunner(address=config.ray_address, init_kwargs={"runtime_env": workers_environment})
    else:
        # a short path: Ray's socket paths must stay under ~107 characters
        temp_dir = tempfile.mkdtemp(prefix="mtrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        runner = RayTaskRunner(
            init_kwargs={
                "address": "local",  # a new Ray: without it, ray.init joins a cluster `ray start` left running
                "num_cpus": os.cpu_count(),
                "include_dashboard": False,
                "_node_ip_address": "127.0.0.1",
                "_temp_dir": temp_dir,
                "log_to_driver": False,
            }
        )
    try:
        with runner:
            yield runner
    finally:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
