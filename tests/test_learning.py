"""The default configuration learns: a real run of the calculator demo (Prefect flow runs, the
store, the embedded policy on CPU) raises the success rate, natively and through an agent program
(slow: ~1 minute)."""

from __future__ import annotations

import json

import pytest

from pipeline.store.versions import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


def test_four_iterations_of_the_default_demo_raise_success_by_twenty_points(tmp_path):
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    # The demo's defaults (64 calculator rollouts, GRPO, one AdamW continued across iterations),
    # 4 iterations instead of 10. Measured on the 2-core machine for seeds 0/1/2: iteration 0
    # 0.33-0.39, iterations 2-3 0.72-0.81.
    config = RunConfig(iterations=4, store={"runs_dir": tmp_path / "runs"})
    results = rl_training(config)
    success = [r["metrics"]["success_rate"] for r in results]
    assert success[-2:] and (success[-2] + success[-1]) / 2 >= success[0] + 0.2, success

    # Every update after the first continued the previous one's AdamW (state saved with the policy).
    store = Store(config.store.runs_dir)
    updates = sorted(store.versions("ppo-update"), key=lambda m: m.iteration)
    restored = [m.extra("optimizer_state_restored") for m in updates]
    assert restored[0] == 0 and all(n > 0 for n in restored[1:]), restored
    assert all(m.extra("memory")["peak_rss_mb"] >= m.extra("memory")["rss_before_mb"] > 0 for m in updates)
    assert json.loads((tmp_path / "runs" / "report" / "summary.json").read_text())[-1]["iteration"] == 3


def test_the_demo_through_the_openai_client_agent_learns_as_the_native_loop_does(tmp_path):
    """The demo's first 4 iterations with the calculator played by an agent program against mtrl's
    endpoint (examples/agents/openai_loop.py) clear the native loop's bar above: success rises by twenty
    points (measured on the 2-core machine: 0.36 at iteration 0, 0.81 over iterations 2-3), no rollout
    failing."""
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    agent = {"function": "examples.agents.openai_loop:agent"}
    results = rl_training(RunConfig(iterations=4, agent=agent, store={"runs_dir": tmp_path / "runs"}))
    success = [r["metrics"]["success_rate"] for r in results]
    assert len(success) == 4 and (success[-2] + success[-1]) / 2 >= success[0] + 0.2, success
    assert all(r["metrics"]["failed_rate"] == 0.0 for r in results)
