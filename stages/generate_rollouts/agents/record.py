"""The record of one agent rollout: every model call as the tokens the model saw and sampled.

A request's context is its messages rendered with the policy's chat template, where every assistant
message the policy sampled earlier in the rollout (matched by its tool-call ids, else by its text)
stands as the tokens sampled, never as a re-tokenization of its text: the sampled text goes into the
template between two markers, and if the template kept it verbatim the markers' span is replaced by
the sampled tokens. While the history only grows, call k+1's context starts with call k's context
and completion, and the rows store only the new tokens (one stream, as native turns); a call whose
request adds only the last reply and tool results renders and tokenizes only those, so that a call
costs the same at call 50 as at call 1 (next_call). When it does
not (the agent edited or summarised its history, the template dropped an earlier <think> block or
rewrote an assistant turn), the call starts a new segment: its whole context is stored and
stream_offset is 0 (schemas/token_stream.py).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from schemas.features import agent_tool_call_id
from schemas.token_stream import generation_prompt_ids, prompt_token_ids
from stages.hermes import parse_tool_calls, split_thinking


class RequestError(ValueError):
    """A request mtrl cannot serve: answered with a 4xx (a JSON error that says why, naming the request's
    field at fault as `param` when one is), and its rollout fails."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param  # e.g. "messages.2.role"


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
    rendering: Rendering | None = field(default=None, repr=False)  # the latest call's: next_call renders from it


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


Reply = tuple[Any, ...] | str  # what ties an assistant message to the call it is the reply of


def _reply_key(message: dict[str, Any]) -> Reply:
    """What an assistant message holds of the call it is the reply of: its tool-call ids, or, with
    none, its text."""
    ids = tuple(call["id"] for call in message.get("tool_calls", []))
    return ids if ids else (message.get("content") or "").strip()


def _call_key(call: Call) -> Reply:
    """The same of a call's reply, as reply_of returned it."""
    return tuple(returned["id"] for returned in call.tool_calls) if call.tool_calls else (call.reply_text or "")


@dataclass
class Rendering:
    """What a call's context was rendered from, kept on the rollout's latest call so that the next
    call of a growing history renders only what its request adds (_render_added)."""

    messages: list[dict[str, Any]]  # the request's canonical messages
    tools: list[dict] | None
    enable_thinking: bool
    earlier: list[Call]  # the sampled calls its assistant messages were matched against
    replies: dict[Reply, Call | None]  # its assistant messages' _reply_key: the call they stand for, or None
    tail: str  # its text after the last sampled turn: what the context's last tokens encode


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
    return _render_whole(tokenizer, messages, tools, earlier, enable_thinking)[0]


def _render_whole(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, earlier: list[Call], enable_thinking: bool
) -> tuple[list[int], Rendering | None]:
    """render_context's tokens, and its Rendering (None when it fell back to the plain rendering)."""
    replies = {_call_key(call): call for call in earlier}  # in order: the latest call with a key wins
    substituted: list[tuple[Call, str]] = []
    marked = []
    for message in messages:
        call = replies.get(_reply_key(message)) if message["role"] == "assistant" else None
        if call is None:
            marked.append(message)
            continue
        text = _sampled_text(tokenizer, call)
        marked.append({"role": "assistant", "content": text + _marker(len(substituted))})
        substituted.append((call, text))
    try:
        text = _template(tokenizer, marked, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    except Exception as exc:  # a template that cannot render these messages
        raise RequestError(f"the policy's chat template cannot render these messages: {exc}") from None
    header = _turn_opening(tokenizer)
    tokens: list[int] = []
    position = 0
    for index, (call, sampled_text) in enumerate(substituted):
        end = text.find(_marker(index), position)
        opening = text.rfind(header, position, end)
        if end < 0 or opening < 0 or not text[opening + len(header) : end].endswith(sampled_text):
            return prompt_token_ids(tokenizer, messages, tools, enable_thinking), None  # rewritten: plain
        tokens += _encode(tokenizer, text[position : end - len(sampled_text)]) + call.completion
        position = _after_turn(tokenizer, text, end + len(_marker(index)), call)
    keys = {_reply_key(message) for message in messages if message["role"] == "assistant"}
    tail = text[position:]
    rendering = Rendering(messages, tools, enable_thinking, earlier, {key: replies.get(key) for key in keys}, tail)
    return tokens + _encode(tokenizer, tail), rendering


def _render_added(
    tokenizer: Any,
    before: Call,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    earlier: list[Call],
    enable_thinking: bool,
) -> tuple[list[int], Rendering] | None:
    """_render_whole's result for a request that adds to `before`'s request only before's reply and
    tool results, from a rendering of those alone after a stand-in user turn; None when that cannot
    be shown.

    It is shown when the request holds before's request's messages unchanged, then before's reply,
    then tool messages; no other call was sampled since, and no earlier message holds before's
    reply but other tokens (the whole rendering would now have it stand for before's); and the
    reply's turn opens as before's generation prompt did and ends with its sampled text. A
    user or system message is rendered whole: a template may rewrite the history before a new query
    (Qwen3's drops its <think> blocks). A template that rewrote earlier turns for a reply and tool
    results (none of the Qwen3 / ChatML family does: a turn is rendered from itself, its neighbours
    and where the last user query is) would be shown its history as the native loop shows it:
    appended to."""
    known = before.rendering
    if known is None or (known.tools, known.enable_thinking) != (tools, enable_thinking):
        return None
    length = len(known.messages)
    if len(earlier) != len(known.earlier) + 1 or any(a is not b for a, b in zip(earlier, known.earlier)):
        return None  # earlier[-1] is before: the calls sampled since its request
    if len(messages) <= length or messages[:length] != known.messages:
        return None  # edited, summarised, or no reply
    reply, added = messages[length], messages[length + 1 :]
    key = _call_key(before)
    if reply["role"] != "assistant" or _reply_key(reply) != key:
        return None
    if key in known.replies and (known.replies[key] is None or known.replies[key].completion != before.completion):
        return None  # an earlier message with this reply would now stand for before's other tokens
    if any(message["role"] != "tool" for message in added):
        return None
    sampled = _sampled_text(tokenizer, before)
    window = [*_STAND_IN, {"role": "assistant", "content": sampled + _marker(0)}, *added]
    try:
        text = _template(tokenizer, window, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
        stand_in, prompt = _stand_in_rendering(tokenizer, json.dumps(tools), enable_thinking)
    except Exception:  # the whole rendering says whether and why the template fails
        return None
    end = text.find(_marker(0), len(stand_in))
    if end < 0 or not text.startswith(stand_in) or text[len(stand_in) : end] != prompt + sampled:
        return None  # the reply's turn does not open as the generation prompt did, or holds more
    if not known.tail.endswith(prompt):
        return None
    # render_context's check of the reply's turn, on the whole rendering's text from before's tail on
    turn, header = known.tail + sampled, _turn_opening(tokenizer)
    opening = turn.rfind(header)
    if opening < 0 or not turn[opening + len(header) :].endswith(sampled):
        return None
    tail = text[_after_turn(tokenizer, text, end + len(_marker(0)), before) :]
    rendering = Rendering(messages, tools, enable_thinking, earlier, {**known.replies, key: before}, tail)
    return before.stream + before.completion + _encode(tokenizer, tail), rendering


# The stand-in history the added messages are rendered after (as schemas/token_stream.py renders
# observations): a user query, so that the reply is the newest turn after it, as in the whole history.
_STAND_IN = [{"role": "user", "content": "q"}]


@functools.lru_cache(maxsize=64)  # per tokenizer and tools: rendered once, not at every call
def _stand_in_rendering(tokenizer: Any, tools_json: str, enable_thinking: bool) -> tuple[str, str]:
    """The stand-in history rendered with these tools, and the generation prompt's text after it."""
    tools = json.loads(tools_json)
    without = _template(tokenizer, _STAND_IN, tools, enable_thinking=enable_thinking)
    prompted = _template(tokenizer, _STAND_IN, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    if not prompted.startswith(without):
        raise ValueError("the chat template's generation prompt is not an append-only suffix")
    return without, prompted[len(without) :]


def _template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, **flags: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **flags)


def _turn_opening(tokenizer: Any) -> str:
    """An assistant turn's opening (render_context looks for it before each sampled text)."""
    return tokenizer.decode(generation_prompt_ids(tokenizer, True))


def _sampled_text(tokenizer: Any, call: Call) -> str:
    return tokenizer.decode(_without_eos(call.completion, tokenizer), skip_special_tokens=False)


def _after_turn(tokenizer: Any, text: str, position: int, call: Call) -> int:
    """Where the text after a sampled turn's marker begins: past the EOS token, which the sampled
    tokens hold already."""
    if call.completion[-1:] == [tokenizer.eos_token_id] and text.startswith(tokenizer.eos_token, position):
        return position + len(tokenizer.eos_token)
    return position


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
    after it (its observation tokens, when the stream goes on).

    A request that adds only the last call's reply and tool results to that call's request is rendered
    from what it adds (_render_added): a call costs the same at call 50 as at call 1. Any other is
    rendered whole."""
    earlier = [call for call in record.calls if call.done.is_set() and call.error is None]
    messages = request.get("messages", [])
    before = earlier[-1] if earlier else None
    rendering, added = None, None
    if "token_ids" in request:
        rendered = list(request["token_ids"])
    else:
        tools = request.get("tools")
        if before is not None:
            added = _render_added(tokenizer, before, messages, tools, earlier, enable_thinking)
        rendered, rendering = added or _render_whole(tokenizer, messages, tools, earlier, enable_thinking)
    continued = before.stream + before.completion if before else None
    call = Call(index=len(record.calls), stream=rendered, context=rendered, new_segment=True, seed=seed)
    call.rendering = rendering
    if continued is not None and len(rendered) > len(continued) and rendered[: len(continued)] == continued:
        delta = rendered[len(continued) :]
        prompt = generation_prompt_ids(tokenizer, enable_thinking)
        split = len(delta) - len(prompt) if delta[-len(prompt) :] == prompt else len(delta)
        before.observation, call.context, call.new_segment = delta[:split], delta[split:], False
    if before is not None:
        key = _call_key(before)
        if added is not None and key not in before.rendering.replies:  # the first message with its reply
            sampled_at: int | None = len(before.rendering.messages)
        else:
            sampled_at = next(
                (i for i, m in enumerate(messages) if m["role"] == "assistant" and _reply_key(m) == key), None
            )
        before.added_messages = messages[sampled_at + 1 :] if sampled_at is not None else []
        before.rendering = None  # only the latest call's is kept: a rollout holds one history, not one per call
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
