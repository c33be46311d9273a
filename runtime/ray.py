"""Ray, imported and connected the same way by everything in mtrl that uses it: the ray runner of
the tool and reward stages (pipeline/orchestration/runners.py), a row-wise stage split over Ray tasks
(map_row_shards) and ppo-update on several nodes (runtime/launch.py)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import datasets

from runtime.threads import THREAD_VARIABLES

# Ray 2.60 would otherwise advertise the machine's LAN address, turn token auth on (writing
# ~/.ray/auth_token) and send usage stats.
RAY_ENVIRONMENT = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


def worker_environment() -> dict[str, str]:
    """What Ray's workers get in their environment: RAY_ENVIRONMENT and this process's thread
    count (runtime/threads.py; Ray would otherwise give each worker one thread per CPU it asks for)."""
    threads = {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}
    return {**RAY_ENVIRONMENT, **threads}


class RayError(ValueError):
    """Ray cannot run what was asked: it is not installed, or no cluster answers at the address."""


class RunnerError(RayError):
    """The ray runner cannot run a stage (no Prefect API for its workers, a process not connected to Ray)."""


def import_ray(purpose: str) -> Any:
    """The ray module, imported with RAY_ENVIRONMENT in this process's environment (before Ray
    starts or connects); `purpose` names what needs it in the error when Ray is not installed."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        import ray
    except ImportError:
        raise RayError(f"{purpose} needs the ray extra: pip install 'mtrl[ray]'") from None
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
        raise RayError(
            f"runner.ray_address {address!r}: no Ray cluster answers there ({exc}); start one with "
            "`ray start --head` or fix the address"
        ) from None


@contextlib.contextmanager
def ray_cluster(address: str | None, purpose: str) -> Iterator[Any]:
    """The ray module, connected: to the cluster at `address` for the duration, or through the
    connection this process already has (the ray runner's)."""
    ray = import_ray(purpose)
    if ray.is_initialized():
        yield ray
        return
    check_ray_address(address)
    ray.init(address=address, runtime_env={"env_vars": worker_environment()}, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def map_row_shards(
    function: Callable[..., datasets.Dataset], rows: datasets.Dataset, runner: str, shards: int, *args: Any
) -> datasets.Dataset:
    """function(rows, *args) for a row-wise stage. With the thread runner, in this process. With
    the ray runner, this process is the stage's Ray task: one shard runs here, more run over
    `shards` contiguous row shards as Ray tasks. The result is rebuilt as one table in row
    order, so it is the same dataset (and the same bytes on disk) either way.

    Outside Ray the ray runner is an error, not a quiet run in this process."""
    if runner == "thread":
        return function(rows, *args)
    ray = import_ray("runner 'ray'")
    if not ray.is_initialized():
        raise RunnerError(
            "runner 'ray', but this process is not connected to Ray: with the ray runner a stage runs as a "
            "Ray task, submitted by the pipeline to the runner that pipeline.orchestration.runners.stage_runner starts; "
            "runner.kind: thread runs it in this process"
        )
    shards = min(shards, len(rows))
    if shards < 2:
        return function(rows, *args)
    remote = ray.remote(function)
    parts = ray.get([remote.remote(rows.shard(shards, i, contiguous=True), *args) for i in range(shards)])
    return datasets.Dataset.from_list([row for part in parts for row in part.to_list()], features=parts[0].features)
