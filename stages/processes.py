"""Child processes that mtrl starts (a vLLM server, torchrun, Prefect's temporary server): a port
for them, and a lifetime no longer than the thread that started them.

Standard library only: pipeline/prefect_env.py imports it before anything heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that must be told its port (it could be
    taken before the server binds it: prefer a server that binds port 0 itself)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def signal_when_parent_dies() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send the child SIGTERM when the thread that started it
    ends, however it ends (a SIGKILLed mtrl included), so no server or training job outlives
    mtrl. The kernel watches the starting *thread*, not the process: start the child from a
    thread that lives as long as the child should. Linux only (None elsewhere). Ray starts its
    own processes this way.

    A preexec_fn makes Python fork with its at-fork hooks, which race with another thread's
    first import of a module that registers such hooks (logging: "cannot release un-acquired
    lock"). A child started while other threads import calls die_with_parent itself instead."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()
    # only prctl and getppid between fork and exec: no lock another thread could hold
    return lambda: _signal_when_parent_dies(prctl, parent)


def die_with_parent(parent: int) -> None:
    """signal_when_parent_dies, called by the child itself (first thing after it starts):
    `parent` is the pid of the process that started it."""
    if sys.platform.startswith("linux"):
        _signal_when_parent_dies(ctypes.CDLL(None, use_errno=True).prctl, parent)


def _signal_when_parent_dies(prctl: Callable[..., int], parent: int) -> None:
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl: the signal will never come
        os._exit(1)
