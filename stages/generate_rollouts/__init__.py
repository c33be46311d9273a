"""generate-rollouts: one assistant turn for every active rollout, token in, token out.

Each rollout's context is its exact token stream (docs/token-stream.md); the engine
(`generation.engine`, engine.py; the HF engine in hf.py) samples the completions. Every
sampled token is stored with its logprob under the convention

    completion_logprobs[i] = log_softmax(logits / temperature)[token_i]

taken before any top-k/top-p truncation, and each rollout turn has its own sampling seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import datasets

from runtime.phases import PHASES
from schemas.config import GenerationConfig, RunConfig
from schemas.features import GENERATE_ROLLOUTS, FinishReason, dataset_from_rows
from schemas.token_stream import (
    CONTEXT_CONVENTION,
    chat_template_hash,
    generation_prompt_ids,
    prompt_token_ids,
    rollouts,
)
from stages.generate_rollouts import hf, vllm_engine  # noqa: F401  (register the "hf" and "vllm" engines)
from stages.generate_rollouts.engine import ENGINES, Completion, GenerationEngine, Request, Sampling
from stages.task_mix import rollout_starts

__all__ = ["ENGINES", "generate_rollouts", "generate_turn", "provenance", "sampling_seed", "split_thinking"]


def sampling_seed(seed: int, iteration: int, rollout_id: int, turn: int) -> int:
    """A 63-bit seed per rollout turn, independent of batch composition."""
    digest = hashlib.sha256(f"{seed}/{iteration}/{rollout_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, content) of an assistant completion decoded without special tokens."""
    if "</think>" not in text:
        return "", text.strip()
    thinking, content = text.rsplit("</think>", 1)
    return thinking.split("<think>", 1)[-1].strip(), content.strip()


def check_context_budget(max_context_tokens: int, max_model_len: int) -> None:
    """A rollout's context budget must fit the model: past its positions the model cannot go
    on, and the rollout would end as a failure instead of a truncation."""
    if max_context_tokens > max_model_len:
        raise ValueError(
            f"generation.max_context_tokens ({max_context_tokens}) exceeds the longest context the model "
            f"takes ({max_model_len} tokens): set it to at most {max_model_len}"
        )


def generate_rollouts(
    engine: GenerationEngine,
    tokenizer: Any,
    *,
    config: GenerationConfig,
    seed: int,
    iteration: int,
    turn: int,
    policy_version: str,
    starts: list[dict[str, Any]] | None = None,
    history: datasets.Dataset | None = None,
    report_progress: Callable[[float], None] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any] | None]:
    """One assistant turn for each active rollout, and how the engine replayed the earlier
    turns first (None: it did not need to).

    Turn 0 takes `starts` (rollout_id, group_id, task, task_id, task_payload, messages,
    tools); later turns take `history`, the execute-tools rows of all earlier turns, and
    continue the rollouts whose last row has no stop_reason. `report_progress` receives the
    share of the turn decoded so far.
    """
    check_context_budget(config.max_context_tokens, engine.max_model_len)
    rows: list[dict[str, Any]] = []
    streams: list[list[int]] = []
    if turn == 0:
        for start in starts or []:
            context = prompt_token_ids(tokenizer, start["messages"], start["tools"], config.enable_thinking)
            rows.append({k: start[k] for k in ("rollout_id", "group_id", "task", "task_id", "task_payload")})
            rows[-1].update(env_state="{}", context_token_ids=context)
            streams.append(context)
    else:
        assert history is not None, "turns after the first continue from the execute-tools history"
        full_streams = {rollout.rollout_id: rollout.token_ids for rollout in rollouts(history)}
        last_rows = {}
        for row in history.select_columns(
            [
                "rollout_id",
                "group_id",
                "task",
                "task_id",
                "task_payload",
                "turn",
                "stop_reason",
                "next_stop",
                "next_env_state",
            ]
        ):
            if row["turn"] == turn - 1 and row["stop_reason"] is None:
                last_rows[row["rollout_id"]] = row
        context = generation_prompt_ids(tokenizer, config.enable_thinking)
        for rollout_id in sorted(last_rows):
            row = last_rows[rollout_id]
            rows.append({k: row[k] for k in ("rollout_id", "group_id", "task", "task_id", "task_payload")})
            rows[-1].update(
                env_state=row["next_env_state"], context_token_ids=list(context), stop=tuple(row["next_stop"] or ())
            )
            streams.append(full_streams[rollout_id] + context)

    requests = []
    for row, stream in zip(rows, streams):
        row["sampling_seed"] = sampling_seed(seed, iteration, row["rollout_id"], turn)
        row["stream_offset"] = len(stream) - len(row["context_token_ids"])
        row["failed"], row["failure"] = False, None
        budget = min(config.max_new_tokens, config.max_context_tokens - len(stream))
        if budget >= 1:  # else a prompt longer than the context: an empty turn, a truncation
            requests.append(Request(row["rollout_id"], stream, row["sampling_seed"], budget, row.pop("stop", ())))
    sampling = Sampling(config.temperature, config.top_k, config.top_p)
    with PHASES.span("stage_compute"):  # the stage's own work, apart from reading and writing (bench/long_episodes.py)
        generation = engine.generate(requests, sampling, earlier_turns=history, report_progress=report_progress)
    completions = {request.key: completion for request, completion in zip(requests, generation.completions)}

    for row in rows:
        row.pop("stop", None)
        completion = completions.get(row["rollout_id"], Completion([], [], FinishReason.LENGTH))
        thinking, content = split_thinking(tokenizer.decode(completion.token_ids, skip_special_tokens=True))
        row.update(
            iteration=iteration,
            turn=turn,
            policy_version=policy_version,
            completion_token_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            thinking=thinking,
            content=content,
        )
    return dataset_from_rows(rows, GENERATE_ROLLOUTS), generation.replay


def generate_turn(
    engine: GenerationEngine,
    tokenizer: Any,
    config: RunConfig,
    *,
    iteration: int,
    turn: int,
    policy_version: str,
    history: datasets.Dataset | None,
    report_progress: Callable[[float], None] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any] | None]:
    """generate-rollouts for one turn of an iteration, configured by the run config: at turn 0
    the iteration's tasks (stages/task_mix.py), later the rollouts of `history` still going on."""
    return generate_rollouts(
        engine,
        tokenizer,
        config=config.generation,
        seed=config.seed,
        iteration=iteration,
        turn=turn,
        policy_version=policy_version,
        starts=rollout_starts(config, iteration) if turn == 0 else None,
        history=history,
        report_progress=report_progress,
    )


def provenance(config: GenerationConfig, seed: int, tokenizer: Any) -> dict[str, Any]:
    """How the rollouts were sampled, for the manifest: settings, conventions, template hash."""
    return {
        "sampling": config.model_dump(mode="json") | {"seed": seed},
        "logprob_convention": "log_softmax(logits / temperature) of the sampled token, before top-k/top-p",
        "context_convention": CONTEXT_CONVENTION,
        "chat_template_sha256": chat_template_hash(tokenizer),
    }
