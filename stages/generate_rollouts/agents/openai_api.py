"""The OpenAI wire formats the endpoint speaks: chat completions (streamed or not) and Responses in,
chat messages out; a recorded call back as a chat completion, its stream chunks, or a Response.

The bodies read here were validated first (protocol.py). They are read as the agent sent them, not
as the models' dumps: the tools reach the chat template with their keys in the agent's order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from stages.generate_rollouts.agents.record import Call, canonical


def chat_request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The canonical messages and tools of a chat-completions body."""
    return [canonical(message) for message in body["messages"]], _tools(body.get("tools"))


def _tools(tools: Any) -> list[dict] | None:
    """Function tools as the chat template takes them ({type: function, function: {...}}), from the chat
    form or the Responses form ({type: function, name, parameters})."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": tool.get("function")
            or {k: tool[k] for k in ("name", "description", "parameters") if k in tool},
        }
        for tool in tools
    ]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def responses_request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """A Responses body's input items as canonical chat messages: instructions as the system message,
    consecutive function_call items as one assistant message's tool calls, function_call_output
    items as tool messages."""
    items = body["input"]
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("closed"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
        else:  # reasoning: the sampled tokens hold it already
            continue
        if messages[-1]["role"] == "assistant" and kind == "message":
            messages[-1]["closed"] = True  # a text reply: later function calls are a new message
    for message in messages:
        message.pop("closed", None)
    return [canonical(message) for message in messages], _tools(body.get("tools"))


FINISH = {"stop": "stop", "stop_string": "stop", "length": "length"}


def _finish(call: Call) -> str:
    return "tool_calls" if call.tool_calls else FINISH.get(call.finish_reason, "stop")


def _logprobs(call: Call, tokenizer: Any) -> dict[str, Any]:
    return {
        "content": [
            {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": None, "top_logprobs": []}
            for token, logprob in zip(call.completion, call.logprobs)
        ]
    }


def _usage(call: Call) -> dict[str, int]:
    prompt = len(call.stream)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": len(call.completion),
        "total_tokens": prompt + len(call.completion),
    }


def chat_completion(call: Call, model: str, request_id: str, tokenizer: Any, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": call.reply_text}
    if call.tool_calls:
        message["tool_calls"] = call.tool_calls
    if call.thinking:
        message["reasoning_content"] = call.thinking
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _finish(call),
                "logprobs": _logprobs(call, tokenizer) if logprobs else None,
            }
        ],
        "usage": _usage(call),
    }


def chat_chunks(call: Call, model: str, request_id: str, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The call as the chunks of a streamed chat completion (the whole reply at once: it is sampled
    before the first byte goes out)."""
    base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    delta: dict[str, Any] = {"role": "assistant", "content": call.reply_text or ""}
    if call.tool_calls:
        delta["tool_calls"] = [{"index": i, **tool_call} for i, tool_call in enumerate(call.tool_calls)]
    yield {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(call)}]}
    if include_usage:
        yield {**base, "choices": [], "usage": _usage(call)}


def response(call: Call, model: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The call as a Responses API response object."""
    output: list[dict[str, Any]] = []
    if call.reply_text:
        output.append(
            {
                "type": "message",
                "id": f"msg_{request_id}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": call.reply_text, "annotations": []}],
            }
        )
    for tool_call in call.tool_calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{tool_call['id']}",
                "call_id": tool_call["id"],
                "name": tool_call["function"]["name"],
                "arguments": tool_call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = _usage(call)
    return {
        "id": request_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if call.finish_reason != "length" else "incomplete",
        "model": model,
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if call.finish_reason == "length" else None,
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def generated(call: Call, request_id: str) -> dict[str, Any]:
    """The call as /inference/v1/generate answers (verifiers' schema: one logprob per token, named
    token_id:N)."""
    return {
        "request_id": request_id,
        "choices": [
            {
                "index": 0,
                "token_ids": call.completion,
                "finish_reason": FINISH.get(call.finish_reason, "stop"),
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{token}", "logprob": logprob}
                        for token, logprob in zip(call.completion, call.logprobs)
                    ]
                },
            }
        ],
    }


def sse(events: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Chat-completion chunks as server-sent events, ended by [DONE]."""
    for event in events:
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def response_events(answer: dict[str, Any]) -> Iterator[bytes]:
    """A Response as the Responses API streams it (each event named and numbered): created, each output
    item added, its text or arguments, done, then completed with the whole response."""
    number = iter(range(10**6))

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(number), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    yield event("response.created", response={**answer, "status": "in_progress", "output": []})
    for index, item in enumerate(answer["output"]):
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", **where, content_index=0, part=part)
            yield event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part={**part, "text": text})
        else:
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
            )
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=answer)
