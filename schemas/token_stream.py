"""The token-stream contract: how a rollout's tokens grow turn by turn.

Token-in-token-out: the model's context is never re-rendered from text. It starts as the
chat-template rendering of the initial messages plus the generation prompt; each turn then
appends the sampled completion (ending in the EOS token <|im_end|>), the *delta* tokens
the chat template would add for the observation messages (tool results or environment
replies), and the generation prompt of the next assistant turn. Deltas are taken from the
model's own chat template, so any template in the Hermes/Qwen family works.

Convention recorded in manifests: earlier turns keep their <think> blocks exactly as sampled
(Qwen3's template would drop them when re-rendering history; we never re-render).

Datasets store one row per assistant turn with only that turn's new tokens; `rollouts(turns)`
is the one place that rebuilds rollouts from them (docs/token-stream.md).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import datasets

CONTEXT_CONVENTION = "sampled-tokens; history never re-rendered; earlier <think> blocks kept"
# Deltas are rendered after a placeholder user message: templates such as Qwen3's re-render
# earlier *assistant* turns when messages follow them, but never an earlier user turn.
_PLACEHOLDER_USER = [{"role": "user", "content": "q"}]
_PLACEHOLDER_ASSISTANT = {"role": "assistant", "content": "a", "reasoning_content": "r"}


def chat_template_hash(tokenizer: Any) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, enable_thinking: bool
) -> list[int]:
    """The first context of a rollout: initial messages + the assistant generation prompt."""
    text = _render(tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    return _encode(tokenizer, text)


@functools.lru_cache(maxsize=64)
def _generation_prompt(tokenizer: Any, enable_thinking: bool) -> tuple[int, ...]:
    without = _render(tokenizer, _PLACEHOLDER_USER, None)
    with_prompt = _render(
        tokenizer, _PLACEHOLDER_USER, None, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    if not with_prompt.startswith(without):
        raise ValueError("the chat template's generation prompt is not an append-only suffix")
    return tuple(_encode(tokenizer, with_prompt[len(without) :]))


def generation_prompt_ids(tokenizer: Any, enable_thinking: bool) -> list[int]:
    """Tokens that open the next assistant turn (e.g. '<|im_start|>assistant\\n')."""
    return list(_generation_prompt(tokenizer, enable_thinking))


@functools.lru_cache(maxsize=64)
def _end_of_assistant_turn(tokenizer: Any) -> str:
    """Text the template puts after an assistant turn's EOS token (usually a newline)."""
    text = _render(tokenizer, _PLACEHOLDER_USER + [_PLACEHOLDER_ASSISTANT], None)
    end = text.rfind(tokenizer.eos_token)
    if end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with {tokenizer.eos_token!r}")
    return text[end + len(tokenizer.eos_token) :]


def assistant_token_ids(tokenizer: Any, message: dict[str, Any], enable_thinking: bool) -> list[int]:
    """The tokens a model writes for this assistant message after the generation prompt, ending
    with the EOS token: what a rollout samples, so that a demonstration (supervised fine-tuning)
    is the completion a rollout would hold. The message is rendered as the newest turn after a
    user turn, where templates such as Qwen3's show its <think> block; with thinking off the
    generation prompt holds an empty <think> block already, so the reasoning is left out."""
    if not enable_thinking:
        message = {key: value for key, value in message.items() if key != "reasoning_content"}
    prompt = _render(tokenizer, _PLACEHOLDER_USER, None, add_generation_prompt=True, enable_thinking=enable_thinking)
    rendered = _render(tokenizer, _PLACEHOLDER_USER + [message], None, enable_thinking=enable_thinking)
    end = _end_of_assistant_turn(tokenizer)
    if not rendered.startswith(prompt) or not rendered.endswith(tokenizer.eos_token + end):
        raise ValueError(
            "the chat template does not render an assistant turn as the generation prompt followed by the turn "
            f"and {tokenizer.eos_token!r}; its completion tokens are undefined"
        )
    return _encode(tokenizer, rendered[len(prompt) : len(rendered) - len(end)])


def observation_token_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Tokens the chat template appends after an assistant turn that ended with the EOS token
    and before the next generation prompt, for the given tool/user messages."""
    before = _render(tokenizer, _PLACEHOLDER_USER, None)
    after = _render(tokenizer, _PLACEHOLDER_USER + messages, None)
    if not after.startswith(before):
        raise ValueError("the chat template re-renders earlier user turns; deltas are undefined")
    # The sampled completion already ends with EOS; what the template puts after it belongs
    # to the observation.
    return _encode(tokenizer, _end_of_assistant_turn(tokenizer) + after[len(before) :])


# ---------------------------------------------------------------------------------------
# The rollout view: rollouts rebuilt from their turn rows
# ---------------------------------------------------------------------------------------

Span = tuple[int, int]  # [start, end) in a rollout's token_ids


@dataclass
class Rollout:
    """One rollout of a dataset of turns: its rows in turn order and its token stream

        token_ids = concat over its turns of context + completion + observation tokens

    with the span of each turn's part in it (a completion span holds the trained tokens).

    A rollout may hold several segments: an agent's call whose context does not extend the call
    before it (the agent edited its history) starts a new one, its context rendered whole
    (stream_offset 0 after turn 0). The model saw each segment alone: `segment_spans` says where
    each begins and ends in token_ids, and a turn's stream starts at its segment's start."""

    rollout_id: int
    rows: list[int] = field(default_factory=list)  # the dataset row of each turn, in turn order
    turns: list[int] = field(default_factory=list)  # their turn numbers (0..n-1 when complete)
    token_ids: list[int] = field(default_factory=list)
    context_spans: list[Span] = field(default_factory=list)
    completion_spans: list[Span] = field(default_factory=list)
    observation_spans: list[Span] = field(default_factory=list)
    failed: bool = False  # a turn is flagged failed: never scored, never trained on
    segment_starts: list[int] = field(default_factory=list)  # positions (in rows) that start a segment

    def segment_start(self, position: int) -> int:
        """Where the segment of the turn at `position` begins in token_ids."""
        first = max(start for start in self.segment_starts if start <= position)
        return self.context_spans[first][0]

    def segment_spans(self) -> list[tuple[list[int], Span]]:
        """Each segment's turn positions and its [start, end) in token_ids."""
        bounds = [*self.segment_starts, len(self.rows)]
        return [
            (list(range(first, last)), (self.context_spans[first][0], self.observation_spans[last - 1][1]))
            for first, last in zip(bounds, bounds[1:])
        ]

    def stream_before(self, position: int) -> list[int]:
        """The tokens the model saw before sampling the completion of the turn at `position`."""
        return self.token_ids[self.segment_start(position) : self.completion_spans[position][0]]


def rollouts(turns: datasets.Dataset) -> list[Rollout]:
    """The rollouts of a dataset of turn rows, by rollout_id, each with its turns in order. A
    dataset without observations (generate-rollouts) has empty observation spans. A turn after the
    first with stream_offset 0 starts a new segment (Rollout)."""
    names = [
        "rollout_id",
        "turn",
        "failed",
        "stream_offset",
        "context_token_ids",
        "completion_token_ids",
        "observation_token_ids",
    ]
    columns = turns.select_columns([n for n in names if n in turns.column_names]).to_dict()
    rows = len(columns["turn"])
    observations = columns.get("observation_token_ids", [[]] * rows)
    failed = columns.get("failed", [False] * rows)
    offsets = columns.get("stream_offset", [None] * rows)
    by_id: dict[int, Rollout] = {}
    for row in sorted(range(rows), key=lambda i: (columns["rollout_id"][i], columns["turn"][i])):
        rollout = by_id.setdefault(columns["rollout_id"][row], Rollout(columns["rollout_id"][row]))
        if not rollout.rows or offsets[row] == 0:
            rollout.segment_starts.append(len(rollout.rows))
        rollout.rows.append(row)
        rollout.turns.append(columns["turn"][row])
        rollout.failed |= bool(failed[row])
        for tokens, spans in (
            (columns["context_token_ids"][row], rollout.context_spans),
            (columns["completion_token_ids"][row], rollout.completion_spans),
            (observations[row], rollout.observation_spans),
        ):
            start = len(rollout.token_ids)
            rollout.token_ids += tokens or []  # a null list (hand-built rows) counts as empty
            spans.append((start, len(rollout.token_ids)))
    return list(by_id.values())


def continue_streams(before: Mapping[int, list[int]], turn: datasets.Dataset) -> dict[int, list[int]]:
    """The token streams of one turn's rollouts after that turn: each rollout's stream before it
    (none before its first turn) + the turn's context, completion and observation tokens. Turn by
    turn this builds what `rollouts` builds from all turns at once, reading each turn once."""
    columns = turn.select_columns(["rollout_id", "context_token_ids", "completion_token_ids", "observation_token_ids"])
    after = {}
    for row in columns.to_list():
        pieces = (row["context_token_ids"], row["completion_token_ids"], row["observation_token_ids"])
        after[row["rollout_id"]] = [
            *before.get(row["rollout_id"], ()),
            *(token for piece in pieces for token in piece or ()),
        ]
    return after
