"""A stage's peak memory is its own: sampled while the block runs, not the process's high-water mark."""

from __future__ import annotations

import time

import torch

from runtime.memory import current_rss_bytes, peak_memory


def test_peak_memory_sees_a_short_lived_allocation_that_is_freed_before_the_end():
    with peak_memory() as memory:
        block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
        with_block_mb = current_rss_bytes() / 2**20 - 1  # the sampler rounds to 0.1 MB
        deadline = time.monotonic() + 60
        while memory.get("peak_rss_mb", 0) < with_block_mb and time.monotonic() < deadline:
            time.sleep(0.001)  # until the sampler has seen the block (its peak so far is readable inside)
        del block
    assert memory["peak_rss_mb"] - memory["rss_before_mb"] >= 200
    assert current_rss_bytes() / 2**20 < memory["peak_rss_mb"] - 150  # freed: the peak is not the current RSS
    with peak_memory() as idle:
        pass
    assert idle["peak_rss_mb"] - idle["rss_before_mb"] < 50
