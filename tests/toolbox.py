"""Misbehaving tools for the tests. A light module on purpose: tool workers load it by file."""

import ctypes
import os
import resource
import sys
import time
from pathlib import Path


def slow_tool(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


def barrier_tool(directory: str, parties: int) -> str:
    """Arrive, then wait until `parties` calls have arrived: alone it never returns (its worker is
    killed at the deadline), so every call answers only if the calls run at the same time.

    Args:
        directory: where each call leaves its mark
        parties: how many calls must arrive
    """
    path = Path(directory)
    (path / f"{os.getpid()}-{time.monotonic_ns()}").touch()
    while len(list(path.iterdir())) < parties:
        time.sleep(0.01)  # polling the condition, not a wait for time to pass
    return f"{parties} arrived"


def failing_tool(x: int) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def spinning_tool() -> str:
    """Never returns and ignores everything but SIGKILL."""
    while True:
        pass


def memory_hog(megabytes: int) -> str:
    """Allocate memory.

    Args:
        megabytes: how much
    """
    block = bytearray(megabytes * 2**20)
    return str(len(block))


def crashing_tool() -> str:
    """Kill its own process, as a segfault in a native library would."""
    os._exit(139)


def segfaulting_tool() -> str:
    """Say what it is about to do, then dereference NULL, as a bug in a native library would."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working directory
    print("loading libfoo", flush=True)  # a worker's stdout is its stderr
    ctypes.string_at(0)
    return "unreachable"


def chatty_tool(megabytes: int) -> str:
    """Write a lot to stderr, then answer.

    Args:
        megabytes: how much
    """
    sys.stderr.write("x" * (megabytes * 2**20))
    return "done"


def long_tool() -> str:
    """Long output."""
    return "x" * 5000


def thread_environment() -> str:
    """The thread count this tool worker's process was started with (OMP_NUM_THREADS)."""
    return os.environ.get("OMP_NUM_THREADS", "unset")
