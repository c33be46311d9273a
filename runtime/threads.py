"""One thread count for every process mtrl runs: generation and training in this process, the
training processes under torchrun, sandboxed tool workers, Ray workers, a vLLM server and the
Prefect server mtrl starts. Children read it from the environment (torch sizes its intra-op pool
from OMP_NUM_THREADS when it is imported); this process also sets torch's pool directly.

Why it matters (measured on 2 cores; docs/performance.md): torch's default is one thread per
core, and mtrl's own processes share those cores. With two threads per process on two busy
cores, every OpenMP barrier waits for a descheduled thread: HF generation of SmolLM2-135M at
batch 32 ran at 11 tok/s with two threads against 89 tok/s with one.
"""

from __future__ import annotations

import os
import sys

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def default_threads(cores: int | None = None) -> int:
    """Half the cores (default: this machine's) per process, at least one: the rest stays free for
    what runs beside the process that computes (mtrl's Prefect server, tool workers, the OS)."""
    return max(1, (cores or os.cpu_count() or 1) // 2)


def use_threads(count: int | None) -> int:
    """Set `count` threads (None: default_threads) for this process and every process it
    starts from now on; returns the count."""
    count = count or default_threads()
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
    return max(1, int(os.environ.get("OMP_NUM_THREADS") or default_threads()) // processes)
