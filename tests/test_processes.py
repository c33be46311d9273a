"""Children mtrl starts die with it: the kernel watches the thread that started a child
(PR_SET_PDEATHSIG), so a child started from a short-lived thread would die with that thread;
popen_for_this_process starts it from a thread that lives as long as the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PARENT = """
import json, subprocess, sys, threading, time
from pathlib import Path
from runtime.processes import dies_with_this_thread, popen_for_this_process

def became_sleep(pid):  # it asked for its signal, then exec'd the program: a thread's end reaches it now
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")[0] != b"sleep" and time.monotonic() < deadline:
        time.sleep(0.01)

children = {}
def start():
    children["thread's"] = subprocess.Popen(dies_with_this_thread(["sleep", "300"])).pid
    children["process's"] = popen_for_this_process(["sleep", "300"]).pid
    for pid in children.values():
        became_sleep(pid)
worker = threading.Thread(target=start)
worker.start()
worker.join()  # the thread that asked for both children has ended
print(json.dumps(children), flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def wait_until(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_child_for_the_process_outlives_the_thread_that_asked_and_dies_with_the_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        children = json.loads(parent.stdout.readline())
        assert wait_until(lambda: not alive(children["thread's"]))  # ended with the thread that started it
        # Not a synchronisation: had it been tied to that thread too, its signal came at the same
        # moment; this is the time it would have had to die (a slow machine can only hide a failure).
        time.sleep(0.5)
        assert alive(children["process's"])
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_until(lambda: not alive(children["process's"]))  # and ends with the process, SIGKILLed
