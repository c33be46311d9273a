"""Misbehaving tools for the tests. A light module on purpose: tool workers load it by file."""

import os
import time


def slow_tool(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


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


def long_tool() -> str:
    """Long output."""
    return "x" * 5000
