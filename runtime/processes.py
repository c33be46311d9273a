"""Child processes that mtrl starts (a vLLM server, torchrun, its Prefect servers, MCP tool
servers, the python tool's programs): a port for them, and a lifetime no longer than the thread
that started them.

    python runtime/processes.py PARENT_PID SIGNAL MODULE ARGS...            (a Python module, as -m)
    python runtime/processes.py PARENT_PID SIGNAL --exec PROGRAM ARGS...    (any program)

(what dies_with_this_thread runs)

Standard library only: pipeline/prefect_plumbing/servers.py imports it before anything heavy, and other
Pythons (a vLLM environment) run it.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that must be told its port (it could be
    taken before the server binds it: prefer a server that binds port 0 itself)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running on this machine (one of another user's counts)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dies_with_this_thread(command: list[str], signal_on_death: int = signal.SIGTERM) -> list[str]:
    """`command` run through this file: the child first asks the kernel for `signal_on_death`
    (SIGTERM: a server may shut down cleanly; SIGKILL: code that must not be able to refuse) when
    the thread that starts it ends, however it ends (a SIGKILLed mtrl included), then becomes the
    command. So no server, training job or tool program outlives mtrl. The kernel watches the
    starting *thread*, not the process: start the child from a thread that lives as long as the
    child should. Ray starts its own processes the same way.

    A `PYTHON -m MODULE ARGS...` command runs MODULE in this file's interpreter, as -m would; any
    other command is exec'd (the request survives exec). The child asks itself, after it starts,
    rather than in a preexec_fn between fork and exec: a preexec_fn makes Python fork with its
    at-fork hooks, which race with another thread's first import of a module that registers such
    hooks (logging: "cannot release un-acquired lock"), and mtrl starts children while other
    threads import and send. This file is run by path, so any Python can run it (a vLLM server's
    own environment has no mtrl): standard library only."""
    head = [str(Path(__file__).resolve()), str(os.getpid()), str(int(signal_on_death))]
    if len(command) >= 3 and command[1] == "-m":
        python, _, module, *arguments = command
        return [python, *head, module, *arguments]
    return [sys.executable, *head, "--exec", *command]


# Its one thread starts at the first submit and lives as long as the process.
_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtrl-launcher")


def popen_for_this_process(command: list[str], signal_on_death: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen:
    """subprocess.Popen(dies_with_this_thread(command, signal_on_death), **popen), started from a
    thread that lives as long as this process: the child outlives the thread that asked for it
    (a flow's background thread, a task's pool) and still dies with the process."""
    return _LAUNCHER.submit(subprocess.Popen, dies_with_this_thread(command, signal_on_death), **popen).result()


def die_with_parent(parent: int, signal_on_death: int = signal.SIGTERM) -> None:
    """`signal_on_death` when the thread of `parent` that started this process ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal_on_death), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl: the signal will never come
        os._exit(1)


if __name__ == "__main__":
    die_with_parent(int(sys.argv[1]), int(sys.argv[2]))
    if sys.argv[3] == "--exec":
        os.execvp(sys.argv[4], sys.argv[4:])
    module = sys.argv[3]
    del sys.argv[1:4]
    sys.path[0] = os.getcwd()  # as under `python -m MODULE`: not this file's folder
    runpy.run_module(module, run_name="__main__", alter_sys=True)
