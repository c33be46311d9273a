"""The model's side of the Hermes / Qwen3 tool-calling format: an assistant message's <think> block
and its <tool_call> blocks (one JSON object each; SmolLM2 writes a JSON list of them). Shared by
execute-tools (it runs the calls) and the agent endpoint (it returns them as OpenAI tool calls).
Nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, content) of an assistant completion decoded without special tokens."""
    if "</think>" not in text:
        return "", text.strip()
    thinking, content = text.rsplit("</think>", 1)
    return thinking.split("<think>", 1)[-1].strip(), content.strip()


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # None, or what is malformed about this call
    id: str = ""


_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _parse_object(payload: Any, call_id: str) -> ToolCall:
    """One call from its decoded JSON: an object with a 'name' string and 'arguments'."""
    if not isinstance(payload, dict):
        return ToolCall("", {}, "tool call must be a JSON object with 'name' and 'arguments'", call_id)
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "tool call has no 'name' string", call_id)
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCall(name, {}, "'arguments' is a string but not valid JSON", call_id)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, "'arguments' must be a JSON object", call_id)
    return ToolCall(name, arguments, None, call_id)


def _parse_block(body: str, closed: bool, first_index: int) -> list[ToolCall]:
    """The calls of one <tool_call> block, numbered from `first_index`: one JSON object (Hermes,
    Qwen3) or a JSON list of them (SmolLM2), each element a call of its own, checked alone, so
    a malformed element does not stop the others."""
    call_id = f"call_{first_index}"
    if not closed:
        return [ToolCall("", {}, "unclosed <tool_call> block", call_id)]
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return [ToolCall("", {}, f"tool call is not valid JSON: {str(exc)[:200]}", call_id)]
    if not isinstance(payload, list):
        return [_parse_object(payload, call_id)]
    if not payload:
        return [ToolCall("", {}, "tool call list is empty: expected JSON objects with 'name' and 'arguments'", call_id)]
    return [_parse_object(element, f"call_{first_index + offset}") for offset, element in enumerate(payload)]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every call of the <tool_call> blocks of an assistant message, in order, numbered call_0,
    call_1, ... across the blocks. Never raises."""
    if not isinstance(text, str):
        return [ToolCall("", {}, "assistant message is not text", "call_0")]
    calls: list[ToolCall] = []
    for match in _CALL_BLOCK.finditer(text):
        calls += _parse_block(match.group(1), match.group(2) == "</tool_call>", len(calls))
    return calls
