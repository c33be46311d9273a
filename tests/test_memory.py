"""A stage's peak memory is its own: sampled while the block runs, not the process's high-water mark."""

from __future__ import annotations

import time

import torch

from runtime.memory import current_rss_bytes, peak_memory


def test_peak_memory_sees_a_short_lived_allocation_that_is_freed_before_the_end():
    with peak_memory() as memory:
        block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
        time.sleep(0.05)  # several sampling intervals
        del block
    assert memory["peak_rss_mb"] - memory["rss_before_mb"] >= 200
    assert current_rss_bytes() / 2**20 < memory["peak_rss_mb"] - 150  # freed: the peak is not the current RSS
    with peak_memory() as idle:
        time.sleep(0.02)
    assert idle["peak_rss_mb"] - idle["rss_before_mb"] < 50
