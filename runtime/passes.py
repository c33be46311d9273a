"""Passes over a model, counted by kind: which forward and backward passes a stage ran, over how
many tokens (the compute-advantages, ppo-update and sft manifests' "passes", the audit's re-score).

Bookkeeping only: what a pass computes is the stages' (stages/policy/), so counting lives here,
outside every stage's hashed code. The counts of one block of code are collected per thread
(a context variable): a batch made beside an update counts its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

PassCounts = dict[str, dict[str, int]]
_PASS_COUNTS: ContextVar[PassCounts | None] = ContextVar("mtrl_pass_counts", default=None)


@contextmanager
def counting_passes() -> Iterator[PassCounts]:
    """Count the passes over the policy that run in this context (this thread), by kind:
    {kind: {"passes", "tokens" (computed: a shared prefix once, no padding), "padded_tokens" (the
    rows' whole width), "targets" (the predicted tokens)}}."""
    counts: PassCounts = {}
    token = _PASS_COUNTS.set(counts)
    try:
        yield counts
    finally:
        _PASS_COUNTS.reset(token)


def count_pass(kind: str, batch: Mapping[str, Any]) -> None:
    """One pass of `kind` over a collated batch (stages.policy.batching.collate), where
    counting_passes counts."""
    counts = _PASS_COUNTS.get()
    if counts is not None:
        add_counts(
            counts,
            {
                kind: {
                    "passes": 1,
                    "tokens": int(batch["tokens"]),
                    "padded_tokens": batch["input_ids"].numel(),
                    "targets": len(batch["targets"]),
                }
            },
        )


def add_counts(into: PassCounts, counts: PassCounts) -> PassCounts:
    """Add `counts` (another rank's, another stage's) into `into`; returns it."""
    for kind, numbers in counts.items():
        entry = into.setdefault(kind, dict.fromkeys(numbers, 0))
        for name, value in numbers.items():
            entry[name] += value
    return into
