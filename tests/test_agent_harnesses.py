"""Whole iterations through the agent programs of examples/agents, each harness as its users run it
(the openai client, the OpenAI Agents SDK on Responses and on chat completions, LangGraph), over real
HTTP on 127.0.0.1; the verifiers one is tests/test_agent_verifiers.py. ppo-update audits each batch
(streams, lengths, a re-score of the stored logprobs) before it trains."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from pipeline.orchestration.flows import rl_training
from schemas.config import RunConfig
from stages.policy.batching import rollout_sequences

RECORDED = {"env_state", "next_env_state"}  # an agent's turns record what it did there; a native turn, its state


def train(runs: Path, **agent) -> dict:
    config = RunConfig(iterations=1, task={"rollouts": 8, "group_size": 4}, agent=agent, store={"runs_dir": str(runs)})
    (result,) = rl_training(config)
    manifest = json.loads((runs / "ppo-update" / result["versions"]["ppo-update"] / "manifest.json").read_text())
    assert manifest["audit"]["ok"] and not manifest["audit"]["problems"], manifest["audit"]
    return result


def turns(runs: Path, stage: str) -> dict[int, datasets.Dataset]:
    """A per-turn stage's versions by turn."""
    found = {}
    for folder in (runs / stage).iterdir():
        rows = datasets.load_from_disk(str(folder))
        found[rows[0]["turn"]] = rows
    return found


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    runs = tmp_path_factory.mktemp("native")
    train(runs)
    return runs


@pytest.mark.slow
def test_the_openai_client_tool_loop_makes_the_native_loops_tokens(native, tmp_path):
    """The example agent shows the model the task's own messages and tools and runs its tool: every
    token the model saw and sampled, every observation and tool call is the native loop's. Only the
    logprobs may differ in the last bits (other batches: prefill shapes)."""
    train(tmp_path, function="examples.agents.openai_loop:agent")
    for stage in ("generate-rollouts", "execute-tools"):
        mine, theirs = turns(tmp_path, stage), turns(native, stage)
        assert sorted(mine) == sorted(theirs) and len(mine) >= 2
        for turn in mine:
            for column in set(mine[turn].column_names) - RECORDED - {"policy_version", "completion_logprobs"}:
                assert mine[turn][column] == theirs[turn][column], (stage, turn, column)
            for a, b in zip(mine[turn]["completion_logprobs"], theirs[turn]["completion_logprobs"]):
                assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "function",
    [
        "examples.agents.agents_sdk:responses",
        "examples.agents.agents_sdk:chat_completions",
        "examples.agents.langgraph_agent:agent",
    ],
)
def test_an_iteration_through_each_harness_trains_on_one_stream_per_rollout(function, tmp_path):
    result = train(tmp_path, function=function)
    assert result["metrics"]["failed_rate"] == 0.0
    generated = turns(tmp_path, "generate-rollouts")
    assert len(generated) >= 2, "no rollout made a second call"
    executed = turns(tmp_path, "execute-tools")
    for turn in sorted(generated)[1:]:  # each later call continues its rollout's stream: a delta
        before = {row["rollout_id"]: row for row in executed[turn - 1]}
        for row in generated[turn]:
            earlier = before[row["rollout_id"]]
            expected = sum(
                len(earlier[n]) for n in ("context_token_ids", "completion_token_ids", "observation_token_ids")
            )
            assert row["stream_offset"] == earlier["stream_offset"] + expected > 0
            assert earlier["tool_calls"] and all(call["result"] is not None for call in earlier["tool_calls"])


@pytest.mark.slow
def test_an_edited_history_trains_each_segment_on_the_tokens_the_model_saw(tmp_path):
    """An agent that sends a summary instead of its history: each call is a segment of its own; the
    audit (streams per segment, the re-score) passes and ppo-update trains each segment alone."""
    result = train(tmp_path, function="tests.agent_programs:edits_history")
    advantaged = datasets.load_from_disk(
        str(tmp_path / "compute-advantages" / result["versions"]["compute-advantages"])
    )
    sequences = rollout_sequences(advantaged)
    assert len(sequences) == 2 * 8  # two calls per rollout, each its own segment
    for sequence in sequences:
        (row,) = sequence.rows
        completion = advantaged[row]["completion_token_ids"]
        assert [sequence.token_ids[p] for p in sequence.target_positions] == completion
        assert sequence.token_ids[: sequence.target_positions[0]] == advantaged[row]["context_token_ids"]
        assert advantaged[row]["stream_offset"] == 0
