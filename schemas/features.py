"""Arrow schemas (`datasets.Features`) of every stage's dataset.

One row is one assistant turn of one rollout. Each stage adds columns to its input's, so a
later stage's dataset is self-contained: load any version with `datasets.load_from_disk`
and it holds everything about those turns. Token IDs are int32 and logprobs float32; both
survive save/load bit-exactly. Only each turn's new tokens are stored (the deltas):

    full token stream of a rollout = concat over turns of
        context_token_ids + completion_token_ids + observation_token_ids
"""

from __future__ import annotations

import json
from enum import StrEnum

from datasets import Dataset, Features, List, Value


class FinishReason(StrEnum):
    """Why generation of one completion stopped (column `finish_reason`)."""

    STOP = "stop"  # an EOS token
    STOP_STRING = "stop_string"  # a stop string the environment set
    LENGTH = "length"  # max_new_tokens, or the context budget
    FAILED = "failed"  # nothing generated: the rollout could not continue (see `failure`)
    REPLAYED = "replayed"  # stored tokens fed back to rebuild an engine's cache (never stored)


class StopReason(StrEnum):
    """Why a rollout ended (column `stop_reason`, on its last turn; null while it goes on)."""

    DONE = "done"  # the environment ended it (final answer, solved, gave up)
    MAX_TURNS = "max_turns"  # cut at the task's turn limit
    CONTEXT_OVERFLOW = "context_overflow"  # the context is full: a completion or the next turn would not fit
    LENGTH = "length"  # the completion was cut at max_new_tokens (with room left in the context)
    FAILED = "failed"  # an infrastructure failure: flagged, never scored


TOKENS = List(Value("int32"))
FLOATS = List(Value("float32"))

GENERATE_ROLLOUTS = Features(
    {
        "rollout_id": Value("int32"),  # unique within an iteration
        "group_id": Value("int32"),  # rollouts of the same task share it
        "task": Value("string"),  # environment name
        "task_id": Value("string"),
        "task_payload": Value("string"),  # JSON of the task (question, hidden answer, ...)
        "env_state": Value("string"),  # JSON of the environment's state before this turn ({} at turn 0)
        "iteration": Value("int32"),
        "turn": Value("int32"),
        "policy_version": Value("string"),
        "sampling_seed": Value("int64"),  # seed of this turn's private generator
        "stream_offset": Value("int32"),  # tokens of the rollout's stream before this turn
        "context_token_ids": TOKENS,  # appended before generation (prompt, or generation prompt)
        "completion_token_ids": TOKENS,  # exactly the sampled tokens
        "completion_logprobs": FLOATS,  # log_softmax(logits / T) of each sampled token
        "finish_reason": Value("string"),  # a FinishReason
        "thinking": Value("string"),
        "content": Value("string"),
        "failed": Value("bool"),  # infrastructure failure: excluded from baselines and loss
        "failure": Value("string"),
    }
)

TOOL_CALL = {
    "id": Value("string"),
    "name": Value("string"),
    "arguments": Value("string"),  # JSON text
    "parse_error": Value("string"),  # null when the call is well formed
    "result": Value("string"),
    "failure_kind": Value("string"),  # null, or malformed | unknown_tool | bad_arguments | raised | timeout | crashed
}

EXECUTE_TOOLS = Features(
    {
        **GENERATE_ROLLOUTS,
        "tool_calls": List(TOOL_CALL),
        "observation": Value("string"),
        "observation_token_ids": TOKENS,  # appended after the completion
        "next_stop": List(Value("string")),  # stop strings the environment set for the next turn
        "next_env_state": Value("string"),  # JSON of the environment's state after this turn
        "turn_reward": Value("float32"),
        "terminated": Value("bool"),  # natural end (final answer, solved, ...)
        "truncated": Value("bool"),  # cut: max turns, context overflow, length
        "stop_reason": Value("string"),  # a StopReason; null while the rollout goes on
    }
)

ASSIGN_REWARDS = Features({**EXECUTE_TOOLS, "reward": Value("float32")})  # final reward, on every row

COMPUTE_ADVANTAGES = Features(
    {
        **ASSIGN_REWARDS,
        "advantages": FLOATS,  # one per completion token
        "returns": FLOATS,  # one per completion token
        "values": FLOATS,  # critic values per completion token (empty without a critic)
        "ref_logprobs": FLOATS,  # reference-policy logprobs (empty without a KL penalty)
    }
)

PPO_UPDATE = Features(  # one row per optimiser step; null where a term is off
    {
        "epoch": Value("int32"),
        "step": Value("int32"),
        "rollouts": Value("int32"),
        "rollouts_computed": Value("int32"),  # the others had advantage 0 and no term that reads them
        "tokens": Value("int32"),
        "learning_rate": Value("float32"),
        "loss": Value("float32"),
        "policy_loss": Value("float32"),
        "value_loss": Value("float32"),
        "kl": Value("float32"),
        "entropy": Value("float32"),
        "clip_fraction": Value("float32"),
        "approx_kl": Value("float32"),
        "grad_norm": Value("float32"),
        "value_grad_norm": Value("float32"),
        "ratio_mean": Value("float32"),
        "ratio_max": Value("float32"),
        "is_weight_mean": Value("float32"),
        "is_weight_max": Value("float32"),
        "logprob_mismatch": Value("float32"),
    }
)

SFT = Features(  # one row per optimiser step of the warm start
    {
        "step": Value("int32"),
        "demonstrations": Value("int32"),
        "tokens": Value("int32"),  # assistant tokens trained on (the loss's)
        "learning_rate": Value("float32"),
        "loss": Value("float32"),  # mean negative log-likelihood per assistant token
        "grad_norm": Value("float32"),
    }
)


AGENT_STATE = "agent"  # the key of an agent rollout's env_state: what the agent did after the call


def agent_state(env_state: str | None) -> dict | None:
    """What an agent rollout's turn recorded after its call (stages/generate_rollouts/agents): the
    tokens and messages the agent added, and on its last call how it ended. None on a native turn."""
    return json.loads(env_state or "{}").get(AGENT_STATE)


def agent_tool_call_id(rollout_id: int, turn: int, number: int) -> str:
    """The id the agent endpoint gives the `number`th tool call of a rollout's call `turn`: execute-tools
    finds the agent's result for it by this id."""
    return f"call_{rollout_id}_{turn}_{number}"


def is_agent_rollout(row: dict) -> bool:
    """Was this turn a call of an agent program, not a turn of the native loop?"""
    return agent_state(row["env_state"]) is not None


def dataset_from_rows(rows: list[dict], features: Features) -> Dataset:
    """A dataset with exactly these features (missing keys become null), also when empty."""
    return Dataset.from_dict({name: [row.get(name) for row in rows] for name in features}, features=features)


def token_counts(dataset: Dataset) -> dict[str, int]:
    """Total context / completion / observation tokens, from Arrow list lengths."""
    counts = {}
    for name in ("context_token_ids", "completion_token_ids", "observation_token_ids"):
        if name in dataset.column_names:
            counts[name.removesuffix("_token_ids")] = sum(
                len(chunk.values) for chunk in dataset.data.column(name).chunks
            )
    return counts
