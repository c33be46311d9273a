"""runtime/phases.py: where a process's time goes, recorded by the code itself."""

from __future__ import annotations

import threading

import pytest


def test_a_span_open_in_two_threads_at_once_counts_both():
    """With ppo.max_staleness the next batch is made in a thread beside ppo-update: a span open in
    both threads at the same moment is two calls (before, the second thread's was dropped as a
    nested span of the first), and a section counts the spans of every thread inside it."""
    from runtime.phases import Phases

    phases = Phases()
    both_inside = threading.Barrier(2)

    def load() -> None:
        with phases.span("load_model"):
            both_inside.wait(timeout=30)

    with phases.section("iteration"):
        beside = threading.Thread(target=load)
        beside.start()
        load()
        beside.join()
    assert phases.calls["load_model"] == 2
    (iteration,) = phases.as_dict()["sections"]["iteration"]
    assert iteration["load_model_s"] == pytest.approx(phases.seconds["load_model"], abs=1e-3)
