"""A verifiers 0.4 environment trained through mtrl: examples/agents/verifiers_agent.py runs each rollout
of the calculator as one rollout of examples/agents/verifiers_calculator in .venv-verifiers, its model
calls made by verifiers' train client (it renders token ids itself and posts them to the rollout's
/inference/v1/generate). Needs .venv-verifiers (`make setup`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import pytest

from examples.agents.verifiers_agent import LOG_VARIABLE, PYTHON
from pipeline.orchestration.flows import rl_training
from schemas.config import RunConfig
from stages.environments import last_integer

ROLLOUTS = 4  # one group, each a verifiers process of its own (seconds of start-up each)


def stored(runs: Path, stage: str) -> list[dict]:
    """Every row of every version of a stage in the store."""
    return [row for version in sorted((runs / stage).iterdir()) for row in datasets.load_from_disk(str(version))]


@pytest.mark.slow
def test_an_iteration_trains_on_multi_turn_verifiers_rollouts_made_with_its_train_client(tmp_path, monkeypatch):
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run `make setup` (it builds .venv-verifiers)")
    log = tmp_path / "verifiers.jsonl"
    monkeypatch.setenv(LOG_VARIABLE, str(log))  # each verifiers rollout's own outcome and timing
    runs = tmp_path / "runs"
    config = RunConfig(
        iterations=1,
        task={"rollouts": ROLLOUTS, "group_size": 4},
        agent={"function": "examples.agents.verifiers_agent:agent", "timeout_s": 300},
        store={"runs_dir": str(runs)},
    )
    started = time.monotonic()
    (result,) = rl_training(config)  # ppo-update audits the batch before it trains: it completed
    wall_s = time.monotonic() - started

    calls: dict[int, list[dict]] = {}
    for row in sorted(stored(runs, "generate-rollouts"), key=lambda row: row["turn"]):
        calls.setdefault(row["rollout_id"], []).append(row)
    assert sorted(calls) == list(range(ROLLOUTS))
    assert not [row["failure"] for rows in calls.values() for row in rows if row["failed"]]
    assert max(len(rows) for rows in calls.values()) >= 2, "no rollout called the calculator and went on"

    # each later call's token ids are the last call's prompt and completion and the tool result: one stream
    observations = {(row["rollout_id"], row["turn"]): row for row in stored(runs, "execute-tools")}
    for rollout_id, rows in calls.items():
        for before, after in zip(rows, rows[1:]):
            tool_result = observations[rollout_id, before["turn"]]
            assert tool_result["tool_calls"] and "<tool_response>" in tool_result["observation"]
            stream = (
                before["stream_offset"]
                + len(before["context_token_ids"])
                + len(before["completion_token_ids"])
                + len(tool_result["observation_token_ids"])
            )
            assert after["stream_offset"] == stream, (rollout_id, after["turn"])

    # verifiers' reward (its @vf.reward) is what mtrl trained on, and mtrl's calculator would give it too
    outcomes = {outcome["rollout_id"]: outcome for outcome in map(json.loads, log.read_text().splitlines())}
    rewards = {row["rollout_id"]: row["reward"] for row in stored(runs, "assign-rewards") if row["terminated"]}
    assert sorted(outcomes) == sorted(rewards) == list(range(ROLLOUTS))
    for rollout_id, rows in calls.items():
        outcome, final = outcomes[rollout_id], rows[-1]
        assert outcome["ok"] and outcome["turns"] == len(rows)
        assert outcome["reward"] == rewards[rollout_id]
        answer = json.loads(final["task_payload"])["answer"]
        assert outcome["reward"] == float(last_integer(final["content"]) == answer)

    manifest = json.loads((runs / "ppo-update" / result["versions"]["ppo-update"] / "manifest.json").read_text())
    assert manifest["audit"]["ok"] and not manifest["audit"]["problems"]
    assert result["metrics"]["failed_rate"] == 0.0 and result["metrics"]["rollouts"] == ROLLOUTS

    startup = [outcome["timing"]["startup"] for outcome in outcomes.values()]
    print(
        f"\nverifiers iteration: {wall_s:.1f} s for {ROLLOUTS} rollouts; verifiers start-up per rollout "
        f"{sum(startup) / len(startup):.1f} s (max {max(startup):.1f} s, {ROLLOUTS} at once)"
    )
