"""Peak memory while one block of code (a stage) runs, not since the process started.

`resource.getrusage(...).ru_maxrss` is the process's high-water mark since it started: in a
run that generated rollouts first, it says nothing about ppo-update alone. So the resident
set is sampled in a thread while the block runs, and on CUDA the allocator's peak counter is
reset when the block starts. Both are the process's: what runs beside the block in another
thread counts too (ppo-update records whose figure it is: `memory.scope`).
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def current_rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


@contextmanager
def peak_memory(interval_s: float = 0.005) -> Iterator[dict[str, Any]]:
    """Yields a dict that, after the block, holds rss_before_mb and peak_rss_mb (the resident
    set sampled every interval_s: a spike shorter than that can be missed; inside the block it
    holds the peak so far) and, on CUDA, cuda_peak_allocated_mb since the block began."""
    result: dict[str, Any] = {}
    before = current_rss_bytes()
    peak = [before or 0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], current_rss_bytes() or 0)
            result["peak_rss_mb"] = round(peak[0] / 2**20, 1)  # the peak so far, readable inside the block

    sampler = threading.Thread(target=sample, name="peak-rss", daemon=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if before is not None:
        sampler.start()
    try:
        yield result
    finally:
        done.set()
        if before is not None:
            sampler.join()
            peak[0] = max(peak[0], current_rss_bytes() or 0)
            result.update(rss_before_mb=round(before / 2**20, 1), peak_rss_mb=round(peak[0] / 2**20, 1))
        if torch.cuda.is_available():
            result["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
