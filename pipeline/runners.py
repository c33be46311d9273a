"""Where execute-tools and assign-rewards run (`runner.kind`).

- `thread`: in the flow's own process (tool calls still run in killable worker processes).
- `ray`: as Ray tasks through prefect-ray, on an in-process local Ray kept on 127.0.0.1, or on
  the cluster at `runner.ray_address`; execute-tools further splits its rows over
  `runner.shards` Ray tasks (tool calls are independent per row); without Ray to run on, an
  error (RunnerError), never a quiet run in this process. Generation and training stay in the
  process that holds the model (training on several nodes, ppo.nodes > 1, runs its own torchrun
  job on the cluster at `runner.ray_address`: pipeline/distributed.py). The runner changes where
  a stage runs, never its version or its bytes.

Which stages may run on Ray is the stage table's `distributed` (pipeline/stage_table.py).

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
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import datasets

from schemas.config import RunnerConfig

# Ray 2.60 would otherwise advertise the machine's LAN address, turn token auth on (writing
# ~/.ray/auth_token) and send usage stats.
RAY_ENVIRONMENT = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


class RunnerError(ValueError):
    """The runner cannot start (no Prefect API for Ray workers, Ray missing, bad address)."""


def import_ray(purpose: str) -> Any:
    """The ray module, imported with RAY_ENVIRONMENT in this process's environment (before Ray
    starts or connects); `purpose` names what needs it in the error when Ray is not installed."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        import ray
    except ImportError:
        raise RunnerError(f"{purpose} needs the ray extra: pip install 'mtrl[ray]'") from None
    return ray


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster address where nothing answers is an error within seconds: ray.init would retry
    for minutes and then exit the process, which Prefect can only report as a crash."""
    if address in (None, "auto", "local"):  # found (or started) by Ray itself
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise RunnerError(
            f"runner.ray_address {address!r}: no Ray cluster answers there ({exc}); start one with "
            "`ray start --head` or fix the address"
        ) from None


@contextlib.contextmanager
def ray_cluster(config: RunnerConfig, purpose: str) -> Iterator[Any]:
    """The ray module, connected: to the cluster at config.ray_address for the duration, or
    through the connection this process already has (the ray runner's)."""
    ray = import_ray(purpose)
    if ray.is_initialized():
        yield ray
        return
    check_ray_address(config.ray_address)
    ray.init(address=config.ray_address, runtime_env={"env_vars": dict(RAY_ENVIRONMENT)}, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


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
    elif config.ray_address:  # the cluster's workers do not inherit this process's environment
        check_ray_address(config.ray_address)
        workers_environment = {"env_vars": {"PREFECT_API_URL": api_url, **RAY_ENVIRONMENT}}
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


def map_row_shards(
    function: Callable[..., datasets.Dataset], rows: datasets.Dataset, config: RunnerConfig, *args: Any
) -> datasets.Dataset:
    """function(rows, *args) for a row-wise stage. With the thread runner, in this process. With
    the ray runner, this process is the stage's Ray task: one shard runs here, more run over
    `config.shards` contiguous row shards as Ray tasks. The result is rebuilt as one table in row
    order, so it is the same dataset (and the same bytes on disk) either way.

    Outside Ray the ray runner is an error, not a quiet run in this process."""
    if config.kind == "thread":
        return function(rows, *args)
    ray = import_ray("runner 'ray'")
    if not ray.is_initialized():
        raise RunnerError(
            "runner 'ray', but this process is not connected to Ray: with the ray runner a stage runs as a "
            "Ray task, submitted by pipeline.flows.run_stage to the runner that stage_runner starts; "
            "runner.kind: thread runs it in this process"
        )
    shards = min(config.shards, len(rows))
    if shards < 2:
        return function(rows, *args)
    remote = ray.remote(function)
    parts = ray.get([remote.remote(rows.shard(shards, i, contiguous=True), *args) for i in range(shards)])
    return datasets.Dataset.from_list([row for part in parts for row in part.to_list()], features=parts[0].features)
