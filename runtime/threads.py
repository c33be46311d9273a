"""One thread count for every process mtrl runs: generation and training in this process, the
training processes under torchrun, sandboxed tool workers, Ray workers, a vLLM server and the
Prefect server mtrl starts. Children read it from the environment (torch sizes its intra-op pool
from OMP_NUM_THREADS when it is imported); this process also sets torch's pool directly.

The default follows what computes at once (measured on 2 cores; docs/performance.md). An
iteration's stages run one after the other, and while one computes the rest of mtrl (its Prefect
server, idle tool workers) barely runs: every core then goes to it (a second thread: up to 1.3x
on an idle machine). With ppo.max_staleness the next batch generates while ppo-update trains, two
compute-bound threads of one process: half the cores each, as a process that shares busy cores
must (with two threads per process on two busy cores every OpenMP barrier waits for a descheduled
thread: HF generation of SmolLM2-135M at batch 32 ran at 11 tok/s with two threads against 89
tok/s with one). A machine shared with other work is the user's to say: runner.threads, or
OMP_NUM_THREADS in mtrl's environment, wins over the default.
"""

from __future__ import annotations

import os
import sys

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# What this process was started with, before use_threads sets it: the user's setting (or, in a
# process mtrl started, the count mtrl gave it).
GIVEN = os.environ.get("OMP_NUM_THREADS")


def default_threads(overlapping: bool, cores: int | None = None) -> int:
    """Threads per process when nobody said: every core (default: this machine's) while one stage
    computes at a time, half of them (at least one) while two compute at once (`overlapping`)."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // 2) if overlapping else cores


def use_threads(count: int | None, overlapping: bool = False) -> int:
    """Set `count` threads for this process and every process it starts from now on (None: the
    OMP_NUM_THREADS this process was started with, else default_threads); returns the count."""
    count = count or (int(GIVEN) if GIVEN and GIVEN.isdigit() and int(GIVEN) > 0 else None)
    count = count or default_threads(overlapping)
    for name in THREAD_VARIABLES:
        os.environ[name] = str(count)
    # vLLM's CPU build pins its workers to cores of its own choosing unless told not to; unpinned,
    # they take OMP_NUM_THREADS like every other process.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    torch = sys.modules.get("torch")  # imported later, it reads OMP_NUM_THREADS itself
    if torch is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def threads_per_process(processes: int) -> int:
    """The thread count for each of `processes` processes that share this machine's share
    (training ranks under torchrun)."""
    return max(1, int(os.environ.get("OMP_NUM_THREADS") or default_threads(overlapping=False)) // processes)
