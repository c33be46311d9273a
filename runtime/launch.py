"""A stage on several processes: launch and supervise a torchrun job of a module (ppo-update's
worker, ppo.world_size > 1), on this machine or on several nodes of a Ray cluster (ppo.nodes > 1).
No RL knowledge: the stage writes its request file and reads what rank 0 wrote beside it.

`run_on_ranks(module, request, placement, log)`:

  1. the caller has written WORK/request.json into a hidden folder of the store (every node sees
     it), removed afterwards (or by the store's clean-up of stale temporary folders if this
     process dies);
  2. one torchrun per node runs world_size / nodes processes of `-m MODULE WORK/request.json`
     (--max-restarts 0: a failed rank fails the job, it is not retried;
     every line of a rank starts with its global rank, [rank<r>]:):
       - one node: torchrun is a child of this process;
       - K nodes: this process connects to the Ray cluster at runner.ray_address, reserves one
         placement-group bundle per node (STRICT_SPREAD: K distinct nodes; a bundle holds the
         CPUs, and GPUs, of that node's processes), and runs on each node a Ray task that
         starts torchrun there and streams its lines back (a Ray streaming generator). This is
         "torchrun on Ray's nodes", as Ray's own release tests launch it; Ray Train would
         replace torchrun and the worker by its own worker actors, and the two launchers
         would no longer share the worker, its output or its failure reports;
  3. one loop (`supervise`) reads every node's lines: it logs them, turns rank 0's progress
     lines into `report_progress` calls and keeps the last lines of each rank and torchrun;
  4. a failure raises TrainingProcessError naming the rank that failed first (torchrun's
     "Root Cause"; over several nodes the earliest one, and the node) and its exit code or
     signal. A rank that dies never leaves the others hanging: its torchrun stops the ranks of
     its node, the ranks of other nodes fail at their next collective (at most
     ppo.collective_timeout_s later), and after FAILURE_GRACE_S their Ray tasks are cancelled;
  5. nothing outlives the job: torchrun gets SIGTERM when the thread that started it ends
     (Linux PR_SET_PDEATHSIG), a SIGKILLed mtrl or a cancelled Ray task included, and stops its
     ranks on SIGTERM;
  6. on success it returns where the ranks ran; rank 0's files are in WORK for the caller (the
     next policy's files, the metrics rows, which ppo-update publishes as in one process).

No port is chosen before it is bound (a port found free and handed on can be taken meanwhile):
on one machine torchrun's rendezvous store binds 127.0.0.1:0, as --standalone does; over Ray
a small actor on node 0 binds it on port 0 and the torchruns of all nodes connect to it. Then
the agent of rank 0 binds the ranks' own store on port 0 as well and hands it to them as
MASTER_PORT (torch 2.13 shares that store with the ranks unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
which brings back a port found free and handed on).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.processes import dies_with_this_thread
from runtime.ray import ray_cluster
from runtime.threads import THREAD_VARIABLES, threads_per_process

ROOT = Path(__file__).resolve().parents[1]  # the repository the workers must import, as this process does
PROGRESS = "mtrl-progress"  # rank 0 prints "mtrl-progress 0.25" after each step: the share done
LAST_LINES = 30  # of each torchrun's own output and of each rank's, kept to quote in a failure
# TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: torchrun --tee starts each line of a rank with "[rank<global rank>]:"
# (its default, "[default<local rank>]:", would repeat the same numbers on every node)
LINE_PREFIX_TEMPLATE = "[rank${rank}]:"
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
PROGRESS_LINE = re.compile(rf"{PROGRESS} ([0-9]+\.[0-9]+)")
# After one node's torchrun failed, the others' ranks fail at their next collective (gloo notices a
# closed peer within a second): their own reports are awaited this long, then their tasks cancelled.
FAILURE_GRACE_S = 5.0
PLACEMENT_TIMEOUT_S = 120.0  # for the Ray cluster to find ppo.nodes distinct nodes with the resources

# What a node's stream carries: (node, a line of its output) ..., then (node, torchrun's exit code).
Event = tuple[int, str | int]


class TrainingProcessError(RuntimeError):
    """A training process exited with an error; the message names its rank."""


@dataclass(frozen=True)
class Placement:
    """Where a job's processes run: `world_size` of them over `nodes` machines (one: this one;
    more: distinct nodes of the Ray cluster at `ray_address`), each on `device` (a GPU each on
    cuda; auto: a GPU where the node has one)."""

    world_size: int
    nodes: int = 1
    ray_address: str | None = None
    device: str = "auto"
    stage: str = "ppo-update"  # named in the failure messages


@dataclass
class Job:
    """A started torchrun job: where its nodes are and the stream of their events."""

    nodes: list[dict[str, Any]]  # per node: "address" (and "ray_node_id" on Ray)
    events: Iterator[Event]

    def name(self, node: int) -> str:
        return node_name(self.nodes, node)


def node_name(nodes: list[dict[str, Any]], node: int) -> str:
    return f"node {node} ({nodes[node]['address']})"


def torchrun_command(
    module: str,
    request: Path,
    *,
    nnodes: int,
    nproc_per_node: int,
    rendezvous: str,
    host_rendezvous: bool,
    local_addr: str,
) -> list[str]:
    """torchrun for this node's share of the ranks. `rendezvous` is the c10d store's HOST:PORT,
    which this torchrun binds when `host_rendezvous` (port 0: the kernel picks a free one);
    `local_addr` is this node's address, the ranks' MASTER_ADDR when rank 0 runs here."""
    return [
        sys.executable,
        "-m",
        "runtime.torchrun",  # torch.distributed.run that never hangs at exit (see there)
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous}",
        f"--rdzv-conf=is_host={str(host_rendezvous).lower()}",
        f"--local-addr={local_addr}",
        "--max-restarts=0",  # a failed rank fails the stage: a retry would train on from a half-done state
        "--tee=3",  # every line of a rank, prefixed with its rank (LINE_PREFIX_TEMPLATE)
        f"--log-dir={request.parent / 'logs'}",
        "-m",
        module,
        str(request),
    ]


def torchrun_output(command: list[str], ranks_here: int) -> Iterator[str | int]:
    """Run torchrun with `ranks_here` ranks on this machine: yield the command line, each line of
    its output, then its exit code. Closing the generator early stops torchrun (and its ranks)."""
    threads = str(threads_per_process(ranks_here))  # the ranks share this process's thread count
    env = {
        **os.environ,
        **dict.fromkeys(THREAD_VARIABLES, threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX_TEMPLATE,
    }
    yield " ".join(command)
    # the thread that starts torchrun reads its output until it exits: it never ends first
    job = subprocess.Popen(
        dies_with_this_thread(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    try:
        for line in job.stdout:
            yield line.rstrip("\n")
        yield job.wait()
    finally:
        if job.poll() is None:  # the reader stopped early (interrupted, or another node failed)
            job.terminate()
            job.wait()


# ---------------------------------------------------------------------------------------
# Where the job runs: this machine, or the nodes of a Ray cluster
# ---------------------------------------------------------------------------------------


def check_devices(placement: Placement) -> None:
    """One GPU per process on CUDA: fail before launching when there are fewer."""
    import torch

    cuda = placement.device == "cuda" or (placement.device == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() < placement.world_size:
        raise TrainingProcessError(
            f"ppo.world_size={placement.world_size} needs one GPU per process; this machine has {torch.cuda.device_count()}"
        )


@contextlib.contextmanager
def torchrun_here(module: str, request: Path, placement: Placement) -> Iterator[Job]:
    """The job as one torchrun, a child of this process."""
    check_devices(placement)
    command = torchrun_command(
        module,
        request,
        nnodes=1,
        nproc_per_node=placement.world_size,
        rendezvous="127.0.0.1:0",
        host_rendezvous=True,
        local_addr="127.0.0.1",
    )
    output = torchrun_output(command, placement.world_size)
    try:
        yield Job([{"address": socket.gethostname()}], ((0, item) for item in output))
    finally:
        output.close()


class RendezvousStore:
    """A Ray actor on node 0 that holds the TCP store of torchrun's c10d rendezvous, bound on
    port 0 (the kernel's choice, kept while the job runs); every node's torchrun connects to it."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from ray.util import get_node_ip_address

        self.address = get_node_ip_address()
        self.store = dist.TCPStore(self.address, 0, is_master=True, multi_tenant=True, wait_for_workers=False)

    def endpoint(self) -> str:
        return f"{self.address}:{self.store.port}"


def torchrun_on_node(
    module: str, request: str, nnodes: int, nproc_per_node: int, rendezvous: str
) -> Iterator[str | int]:
    """A Ray task on one node: that node's torchrun, its lines streamed back, then its exit code."""
    from ray.util import get_node_ip_address

    address = get_node_ip_address()
    if not Path(request).is_file():
        raise TrainingProcessError(
            f"{request} is not on the node at {address}: with ppo.nodes > 1 the runs directory (store.runs_dir) "
            "must be on a filesystem every node sees, at the same path"
        )
    command = torchrun_command(
        module,
        Path(request),
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rendezvous=rendezvous,
        host_rendezvous=False,
        local_addr=address,
    )
    yield from torchrun_output(command, nproc_per_node)


def node_streams(ray: Any, tasks: dict[Any, int], nodes: list[dict[str, Any]]) -> Iterator[Event]:
    """The events of every node's task, as they come. Once a node's torchrun failed, the others
    get FAILURE_GRACE_S to end with their own reports; then the stream ends (the caller cancels
    what still runs). A task that fails in Ray (its node lost, the request unreadable) fails the job."""
    running = dict(tasks)
    grace_ends: float | None = None
    while running:
        timeout = None if grace_ends is None else max(0.0, grace_ends - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
        if not ready:
            return
        node = running[ready[0]]
        try:
            item = ray.get(next(ready[0]))
        except StopIteration:
            del running[ready[0]]
            continue
        except ray.exceptions.RayError as error:
            cause = getattr(error, "cause", None) or error  # a task's own exception, else Ray's
            raise TrainingProcessError(
                f"the Ray task of {node_name(nodes, node)} failed; nothing was written.\n{cause}"
            ) from None
        yield node, item
        if isinstance(item, int) and item != 0 and grace_ends is None:
            grace_ends = time.monotonic() + FAILURE_GRACE_S


@contextlib.contextmanager
def torchrun_on_ray(module: str, request: Path, placement: Placement) -> Iterator[Job]:
    """The job as one torchrun on each of placement.nodes distinct nodes of the Ray cluster."""
    nodes, per_node = placement.nodes, placement.world_size // placement.nodes
    with ray_cluster(placement.ray_address, purpose=f"ppo.nodes={nodes}") as ray:
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = placement.device == "cuda" or (placement.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        bundle = {"CPU": per_node, **({"GPU": per_node} if gpus else {})}
        group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD")
        tasks: dict[Any, int] = {}
        store = None
        try:
            try:
                ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                alive = [
                    f"{n['NodeManagerAddress']} "
                    + str({k: n["Resources"][k] for k in ("CPU", "GPU") if k in n["Resources"]})
                    for n in ray.nodes()
                    if n["Alive"]
                ]
                raise TrainingProcessError(
                    f"ppo.nodes={nodes}: the Ray cluster found no {nodes} distinct nodes with {bundle} free each "
                    f"within {PLACEMENT_TIMEOUT_S:.0f} s; its nodes: {'; '.join(alive)}"
                ) from None
            node_ids = placement_group_table(group)["bundles_to_node_id"]
            addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            where = [{"address": addresses[node_ids[i]], "ray_node_id": node_ids[i]} for i in range(nodes)]

            def on_node(i: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

            store = ray.remote(RendezvousStore).options(num_cpus=0, scheduling_strategy=on_node(0)).remote()
            rendezvous = ray.get(store.endpoint.remote())
            node_task = ray.remote(
                num_returns="streaming", num_cpus=per_node, num_gpus=per_node if gpus else 0, max_retries=0
            )(torchrun_on_node)
            for i in range(nodes):
                run = node_task.options(scheduling_strategy=on_node(i)).remote(
                    module, str(request), nodes, per_node, rendezvous
                )
                tasks[run] = i
            yield Job(where, node_streams(ray, tasks, where))
        finally:
            for run in tasks:  # no effect on a finished task; a killed one takes its torchrun along
                ray.cancel(run, force=True)
            if store is not None:
                ray.kill(store)
            remove_placement_group(group)


# ---------------------------------------------------------------------------------------
# Supervision: one loop for both
# ---------------------------------------------------------------------------------------


@dataclass
class RootCause:
    """The first failure torchrun reports on its node ("Root Cause (first observed failure)")."""

    time: str  # as torchrun prints it, 2026-11-25_10:03:12: ordered as text; "~" when it reported none
    rank: str | None
    exitcode: int | None

    @classmethod
    def parse(cls, report: str) -> RootCause:
        root = report[report.find("Root Cause") :] if "Root Cause" in report else ""
        when = re.search(r"time\s*:\s*(\S+)", root)
        rank = re.search(r"rank\s*:\s*(\d+)", root)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
        return cls(
            when.group(1) if when else "~", rank.group(1) if rank else None, int(code.group(1)) if code else None
        )


def failure_message(
    failed: list[tuple[int, int]],
    world_size: int,
    tails: dict[str, deque[str]],
    job: Job | None = None,
    stage: str = "ppo-update",
) -> str:
    """Which rank failed first and how, from the "Root Cause" that torchrun reports on each
    failed node (`failed`: (node, exit code) in the order they ended): the earliest one, and
    between equal times (torchrun prints seconds) the node that ended first. With that rank's
    last lines of output (its traceback) and its torchrun's; its node named when `job` has several."""
    causes = [(node, code, RootCause.parse("\n".join(tails[f"node {node}"]))) for node, code in failed]
    node, returncode, cause = min(causes, key=lambda failure: failure[2].time)
    where = f" on {job.name(node)}" if job is not None and len(job.nodes) > 1 else ""
    if cause.rank is not None:
        who = f"rank {cause.rank} of {world_size}"
    else:
        who = f"a rank of {world_size} (torchrun exit {returncode})"
    how = ""
    if cause.exitcode is not None:
        value = cause.exitcode
        how = f" (killed by {signal.Signals(-value).name})" if value < 0 else f" (exit code {value})"
    own = "\n".join(tails.get(f"rank {cause.rank}", [])) if cause.rank is not None else ""
    report = "\n".join(tails[f"node {node}"])
    return (
        f"{stage} failed: training process {who}{where} died{how}; no policy was written.\n"
        f"Its last lines:\n{own}\ntorchrun{where}:\n{report}"
    )


def supervise(
    job: Job, placement: Placement, log: Callable[[str], None], report_progress: Callable[[float], None] | None
) -> dict[int, set[int]]:
    """Read the job's events to their end: log every line (torchrun's own with its node when
    there are several), report rank 0's progress, keep the last lines of each rank and torchrun.
    Raises TrainingProcessError when a torchrun failed; returns the ranks that ran on each node."""
    tails: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=LAST_LINES))  # "rank 1", "node 0", ...
    ranks_on: dict[int, set[int]] = defaultdict(set)
    failed: list[tuple[int, int]] = []
    several = len(job.nodes) > 1
    for node, item in job.events:
        if isinstance(item, int):
            if item != 0:
                failed.append((node, item))
            continue
        rank = RANK_PREFIX.match(item)
        text = item[rank.end() :] if rank else item
        progress = PROGRESS_LINE.fullmatch(text) if rank else None
        if progress:
            if report_progress is not None:
                report_progress(float(progress.group(1)))
            continue
        if rank:
            ranks_on[node].add(int(rank.group(1)))
        tails[f"rank {rank.group(1)}" if rank else f"node {node}"].append(text)
        # any other line, and a progress line that torchrun's tee glued to the next one
        log(f"[{job.name(node)}] {item}" if several and not rank else item)
    if failed:
        raise TrainingProcessError(failure_message(failed, placement.world_size, tails, job, placement.stage))
    return ranks_on


def run_on_ranks(
    module: str,
    request: Path,
    placement: Placement,
    log: Callable[[str], None],
    report_progress: Callable[[float], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `python -m MODULE REQUEST` as placement.world_size processes on placement.nodes nodes, to
    the end; returns where they ran (per node: its address, its Ray node id, its ranks). What rank 0
    wrote is in the request's folder."""
    world, nodes = placement.world_size, placement.nodes
    log(f"{placement.stage} on {world} processes, {world // nodes} on each of {nodes} node(s)")
    launch = torchrun_on_ray if placement.nodes > 1 else torchrun_here
    with launch(module, request, placement) as job:
        ranks_on = supervise(job, placement, log, report_progress)
    return [{**where, "ranks": sorted(ranks_on[node])} for node, where in enumerate(job.nodes)]
