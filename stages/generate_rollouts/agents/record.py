"""The record of one agent rollout: every model call as the tokens the model saw and sampled.

A request's context is its messages rendered with the policy's chat template, where every assistant
message the policy sampled earlier in the rollout (matched by its tool-call ids, else by its text)
stands as the tokens sampled, never as a re-tokenization of its text: the sampled text goes into the
template between two markers, and if the template kept it verbatim the markers' span is replaced by
the sampled tokens. While the history only grows, call k+1's context starts with call k's context
and completion, and the rows store only the new tokens (one stream, as native turns). When it does
not (the agent edited or summarised its history, the template dropped an earlier <think> block or
rewrote an assistant turn), the call starts a new segment: its whole context is stored and
stream_offset is 0 (schemas/token_stream.py).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from schemas.features import agent_tool_call_id
from schemas.token_stream import generation_prompt_ids, prompt_token_ids
from stages.hermes import parse_tool_calls, split_thinking


class RequestError(ValueError):
    """A request mtrl cannot serve: answered with a 4xx that says why, and its rollout fails."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _marker(index: int) -> str:
    return f"\u27e6mtrl-sampled-{index}\u27e7"


@dataclass
class Call:
    """One model call of a rollout."""

    index: int  # its turn
    stream: list[int]  # the segment's tokens the model saw before sampling
    context: list[int]  # the new tokens of this call (the whole stream when it starts a segment)
    new_segment: bool
    seed: int
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    thinking: str = ""
    content: str = ""  # the completion's text after any <think> block
    reply_text: str | None = None  # the message content returned (tool-call blocks taken out)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # returned as OpenAI tool calls
    observation: list[int] = field(default_factory=list)  # tokens the next call added, in this segment
    added_messages: list[dict[str, Any]] = field(default_factory=list)  # messages the agent added after it
    done: threading.Event = field(default_factory=threading.Event)
    error: RequestError | None = None


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the template and the matching see it: null or empty fields dropped, the
    content of a list of text parts joined, tool calls reduced to id, name and arguments."""
    kept: dict[str, Any] = {"role": message.get("role")}
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if content not in (None, ""):
        kept["content"] = content
    for name in ("tool_call_id", "name", "reasoning_content"):
        if message.get(name) not in (None, ""):
            kept[name] = message[name]
    calls = message.get("tool_calls") or []
    if calls:
        kept["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": call["function"].get("arguments", "{}")},
            }
            for call in calls
        ]
    if kept["role"] in ("tool", "user", "system", "developer") and "content" not in kept:
        kept["content"] = ""
    return kept


class RolloutRecord:
    """The calls of one rollout, in order, and how it ended."""

    def __init__(self, start: dict[str, Any], call_limit: int):
        self.start = start  # its identity: rollout_id, group_id, task, task_id, task_payload
        self.call_limit = call_limit
        self.calls: list[Call] = []
        self.answered: dict[str, Call] = {}  # request digest -> its call: a retry is answered from it
        self.failure: str | None = None
        self.cut = False  # a call past the limit was refused
        self.reward: float | None = None  # what the agent returned
        self.lock = threading.Lock()

    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None and not self.cut:
                self.failure = message[:1000]


def _sampled_match(message: dict[str, Any], earlier: list[Call]) -> Call | None:
    """The earlier call whose reply this assistant message is: the same tool-call ids, or, with no
    tool calls, the same text."""
    ids = [call["id"] for call in message.get("tool_calls", [])]
    for call in reversed(earlier):
        if ids and ids == [returned["id"] for returned in call.tool_calls]:
            return call
        if not ids and not call.tool_calls and (message.get("content") or "").strip() == (call.reply_text or ""):
            return call
    return None


def render_context(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    earlier: list[Call],
    enable_thinking: bool,
) -> list[int]:
    """The tokens the model sees for these messages (module docstring): the template's rendering with
    the earlier sampled assistant messages as their sampled tokens, where the template kept them
    verbatim; else the plain rendering (a new segment).

    A matched message goes into the template as its sampled text followed by a marker; the template
    is free to rewrite it (Qwen3's drops <think> blocks before the last user query). The rendered
    turn is what lies between the assistant header before the marker and the marker: when it ends
    with the sampled text, the sampled tokens stand for that text."""
    substituted: list[tuple[Call, str]] = []
    marked = []
    for message in messages:
        call = _sampled_match(message, earlier) if message["role"] == "assistant" else None
        if call is None:
            marked.append(message)
            continue
        text = tokenizer.decode(_without_eos(call.completion, tokenizer), skip_special_tokens=False)
        marked.append({"role": "assistant", "content": text + _marker(len(substituted))})
        substituted.append((call, text))
    try:
        text = tokenizer.apply_chat_template(
            marked, tools=tools or None, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
    except Exception as exc:  # a template that cannot render these messages
        raise RequestError(f"the policy's chat template cannot render these messages: {exc}") from None
    header = tokenizer.decode(generation_prompt_ids(tokenizer, True))  # an assistant turn's opening
    tokens: list[int] = []
    position = 0
    for index, (call, sampled_text) in enumerate(substituted):
        end = text.find(_marker(index), position)
        opening = text.rfind(header, position, end)
        if end < 0 or opening < 0 or not text[opening + len(header) : end].endswith(sampled_text):
            return prompt_token_ids(tokenizer, messages, tools, enable_thinking)  # rewritten: plain
        tokens += _encode(tokenizer, text[position : end - len(sampled_text)]) + call.completion
        position = end + len(_marker(index))
        if call.completion[-1:] == [tokenizer.eos_token_id] and text.startswith(tokenizer.eos_token, position):
            position += len(tokenizer.eos_token)  # the sampled tokens hold the turn's end already
    return tokens + _encode(tokenizer, text[position:])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def _without_eos(tokens: list[int], tokenizer: Any) -> list[int]:
    return tokens[:-1] if tokens[-1:] == [tokenizer.eos_token_id] else tokens


def next_call(
    record: RolloutRecord,
    tokenizer: Any,
    request: dict[str, Any],
    enable_thinking: bool,
    seed: int,
) -> Call:
    """The record's next call for a request: {"messages", "tools"} (canonical messages, rendered here)
    or {"token_ids"} (a client that renders itself). Its context continues the last call's segment
    when it extends it, else starts a new segment. The previous call learns what the agent added
    after it (its observation tokens, when the stream goes on)."""
    earlier = [call for call in record.calls if call.done.is_set() and call.error is None]
    messages = request.get("messages", [])
    if "token_ids" in request:
        rendered = list(request["token_ids"])
    else:
        rendered = render_context(tokenizer, messages, request.get("tools"), earlier, enable_thinking)
    before = earlier[-1] if earlier else None
    continued = before.stream + before.completion if before else None
    call = Call(index=len(record.calls), stream=rendered, context=rendered, new_segment=True, seed=seed)
    if continued is not None and len(rendered) > len(continued) and rendered[: len(continued)] == continued:
        delta = rendered[len(continued) :]
        prompt = generation_prompt_ids(tokenizer, enable_thinking)
        split = len(delta) - len(prompt) if delta[-len(prompt) :] == prompt else len(delta)
        before.observation, call.context, call.new_segment = delta[:split], delta[split:], False
    if before is not None:
        sampled_at = next(
            (i for i, m in enumerate(messages) if m["role"] == "assistant" and _sampled_match(m, [before])), None
        )
        before.added_messages = messages[sampled_at + 1 :] if sampled_at is not None else []
    return call


def reply_of(call: Call, tokenizer: Any, rollout_id: int) -> None:
    """Fill in what the call returns: its text after <think>, and its tool calls as OpenAI tool calls
    (all of them well formed: else none, and the text as it is, for the agent to read)."""
    thinking, content = split_thinking(tokenizer.decode(call.completion, skip_special_tokens=True))
    call.thinking, call.content = thinking, content
    parsed = parse_tool_calls(content)
    if parsed and all(found.error is None for found in parsed):
        call.tool_calls = [
            {
                "id": agent_tool_call_id(rollout_id, call.index, number),
                "type": "function",
                "function": {"name": found.name, "arguments": json.dumps(found.arguments)},
            }
            for number, found in enumerate(parsed)
        ]
        outside = content.split("<tool_call>", 1)[0].strip()
        call.reply_text = outside or None
    else:
        call.reply_text = content
