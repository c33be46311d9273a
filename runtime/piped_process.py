"""A child process that takes one request on stdin and reports on a pipe of its own, its stdout and
stderr being one more pipe (its output): started on this machine, or by a Ray task on a node of a
cluster, and read the same way, as a stream of events.

    start_piped(command, environment)      the process, waiting for its request (it may be started ahead)
    run_piped(process, request)            send the request; yield its events until it is done; kill it
    run_piped_on_node(...)                 the same as a Ray task (num_returns="streaming") on a node

The events, in batches of what has come (a list per yield, so a chatty process costs one Ray object
per batch, not per line):

    (OUTPUT, bytes)     a line of its output (the last one may lack its newline)
    (REPORT, str)       a line of its reports' pipe: nothing the process prints can be read as one
    (STARTED, dict)     first, from a Ray task only: where it runs (node id and address, the worker's pid)
    (EXITED, int)       last: its exit code (negative: the signal that killed it)

The process gets the write end of the reports' pipe by number, as its command's last argument. It
runs in a session of its own, so whatever it starts is in its process group, killed with it when its
reports end (it exited, or closed them), when the reader stops, or, by the kernel, when the process
that started it dies however it dies (runtime/processes.py): on a node, its Ray worker.

No RL knowledge, and light: a Ray worker imports this module to run its task, and must not import
what the rest of mtrl imports (torch, transformers: seconds and hundreds of MB per worker)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from runtime.processes import popen_for_this_process

OUTPUT, REPORT, STARTED, EXITED = "output", "report", "started", "exited"
Event = tuple[str, Any]
# After its reports end, the process and its group are killed; a process it started in a session of
# its own may still hold the output pipe open: what it writes is read this long, no longer.
OUTPUT_GRACE_S = 5.0
REACH_TIMEOUT_S = 5.0  # for a node to open a TCP connection to the address its process needs


@dataclass
class PipedProcess:
    """A started process: the child, the read end of its reports' pipe, and what it was started with."""

    child: subprocess.Popen
    reports: IO[str]
    command: list[str]
    environment: dict[str, str]


class UnreachableError(ConnectionError):
    """A node cannot open a TCP connection to the address its process needs."""


def start_piped(command: list[str], environment: dict[str, str], cwd: str | None = None) -> PipedProcess:
    """`command` + [the reports' fd], waiting for its request on stdin; SIGKILLed when this process
    dies, however it dies. Its stdout and stderr are one pipe, its output."""
    reports, reports_end = os.pipe()  # both close-on-exec: only the child gets its end (pass_fds)
    try:
        child = popen_for_this_process(
            [*command, str(reports_end)],
            signal.SIGKILL,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(reports_end,),
            env=environment,
            cwd=cwd,
            start_new_session=True,  # what it starts is in its group, killed with it
        )
    except BaseException:
        os.close(reports)
        raise
    finally:
        os.close(reports_end)  # the child's copy is the only one left: its exit ends the reports
    return PipedProcess(child, open(reports, encoding="utf-8"), command, environment)


def kill(process: PipedProcess) -> None:
    """Kill the process and its process group (its pipes close as their readers reach their end)."""
    try:
        os.killpg(process.child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.child.wait()


def close(process: PipedProcess) -> None:
    """Kill a process that was never sent its request, and close the pipes nothing reads."""
    kill(process)
    process.reports.close()
    process.child.stdout.close()


def run_piped(process: PipedProcess, request: bytes) -> Iterator[list[Event]]:
    """Send `request` (then close stdin) and yield the process's events as they come until its
    reports end; then kill it and its group, yield what is left of its output (for OUTPUT_GRACE_S
    at most) and last (EXITED, its exit code). Killed too when the caller stops reading."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    for pipe, kind in ((process.child.stdout, OUTPUT), (process.reports, REPORT)):
        threading.Thread(target=_pump, args=(pipe, kind, events), name=f"piped-{kind}", daemon=True).start()
    try:
        process.child.stdin.write(request)
        process.child.stdin.close()
    except BrokenPipeError:  # it died first: its exit code and output say why
        pass
    open_pipes = {OUTPUT, REPORT}
    try:
        while REPORT in open_pipes:
            if batch := _take(events, None, open_pipes):
                yield batch
        try:
            process.child.wait(OUTPUT_GRACE_S)  # its reports ended: it exits
        except subprocess.TimeoutExpired:
            pass
        kill(process)  # and whatever it left running in its group with it
        grace_ends = time.monotonic() + OUTPUT_GRACE_S
        while OUTPUT in open_pipes and (left := grace_ends - time.monotonic()) > 0:
            if batch := _take(events, left, open_pipes):
                yield batch
    finally:
        kill(process)
    yield [(EXITED, process.child.returncode)]


def _pump(pipe: IO[Any], kind: str, events: queue.SimpleQueue[Event]) -> None:
    """Put each line of `pipe` on `events` as (kind, line), then (kind, None): it ended (also when
    reading failed: the reader never waits for a pipe nothing reads)."""
    try:
        with pipe:
            for line in pipe:
                events.put((kind, line))
    finally:
        events.put((kind, None))


def _take(events: queue.SimpleQueue[Event], timeout: float | None, open_pipes: set[str]) -> list[Event]:
    """The events there now, waiting up to `timeout` for the first; a pipe's end is taken out of
    `open_pipes` instead."""
    batch: list[Event] = []
    try:
        event = events.get(timeout=timeout)
        while True:
            if event[1] is None:
                open_pipes.discard(event[0])
            else:
                batch.append(event)
            event = events.get_nowait()
    except queue.Empty:
        return batch


def find_program(program: str | None, cwd: str | None = None) -> str | None:
    """The absolute path of `program` (a path relative to `cwd`, or a command on PATH), not
    resolved (a virtualenv's python is a link that must stay one); None: this process's Python.
    None when there is no such executable file."""
    if program is None:
        return sys.executable
    here = os.getcwd() if cwd is None else cwd
    found = shutil.which(program if os.path.isabs(program) or os.sep not in program else os.path.join(here, program))
    return None if found is None else os.path.abspath(found)


def run_piped_on_node(
    program: str | None,
    arguments: list[str],
    extra_environment: dict[str, str],
    cwd: str,
    request: bytes,
    reach: tuple[str, int] | None = None,
) -> Iterator[list[Event]]:
    """A Ray task: `program` (None: the worker's own Python; else a path relative to `cwd` on this
    node, or a command on its PATH) with `arguments`, started on this node in `cwd` with the node's
    environment and `extra_environment`, its events streamed back after a first (STARTED, where).
    `reach`, (host, port): an address the process needs, checked from this node first. The process
    dies with this worker (a worker killed, its node lost, the task cancelled)."""
    import ray
    from ray.util import get_node_ip_address

    address = get_node_ip_address()
    if not os.path.isdir(cwd):
        raise FileNotFoundError(f"the working directory {cwd} is not on the node at {address}")
    executable = find_program(program, cwd)
    if executable is None:
        raise FileNotFoundError(
            f"{program} is no executable file on the node at {address} (relative to {cwd}, or on PATH)"
        )
    if reach is not None:
        try:
            socket.create_connection(reach, timeout=REACH_TIMEOUT_S).close()
        except OSError as exc:
            raise UnreachableError(
                f"{reach[0]}:{reach[1]} cannot be reached from the node at {address} ({exc})"
            ) from None
    process = start_piped([executable, *arguments], {**os.environ, **extra_environment}, cwd)
    where = {
        "pid": process.child.pid,
        "program": executable,
        "worker_pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "address": address,
    }
    yield [(STARTED, where)]
    yield from run_piped(process, request)
