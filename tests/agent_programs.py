"""Agent programs the agent tests run (tests/test_agents.py): each misbehaves on the odd rollouts in
one way and runs the calculator's tool loop (examples/agents/openai_loop.py) on the others."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import sys
import time
from urllib.parse import urlsplit

import openai

from examples.agents.openai_loop import agent as calculator
from examples.agents.openai_loop import run_tool


async def raises(rollout) -> float | None:
    if rollout.rollout_id % 2:
        await rollout.client.chat.completions.create(
            model=rollout.model, messages=rollout.messages, tools=rollout.tools
        )
        raise RuntimeError("the agent's own bug")
    return await calculator(rollout)


async def hangs(rollout) -> float | None:
    if rollout.rollout_id % 2:
        await rollout.client.chat.completions.create(
            model=rollout.model, messages=rollout.messages, tools=rollout.tools
        )
        await asyncio.sleep(3600)
    return await calculator(rollout)


def hangs_in_sync_code(rollout) -> float:
    """A sync agent that never returns on odd rollouts (its thread cannot be cancelled: the deadline
    fails the rollout, and the process is killed at the end)."""
    client = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.api_key)
    client.chat.completions.create(model=rollout.model, messages=rollout.messages, tools=rollout.tools)
    if rollout.rollout_id % 2:
        time.sleep(3600)
    return 0.5


async def returns_rewards(rollout) -> float:
    await calculator(rollout)
    return float(rollout.rollout_id) / 10


async def edits_history(rollout) -> None:
    """Call 2 sends a summary instead of the history: a new segment."""
    reply = await rollout.client.chat.completions.create(
        model=rollout.model, messages=rollout.messages, tools=rollout.tools
    )
    message = reply.choices[0].message
    summary = list(rollout.messages) + [
        {"role": "assistant", "content": f"Earlier I wrote: {(message.content or '')[:40]}"},
        {"role": "user", "content": "Now give the final answer."},
    ]
    await rollout.client.chat.completions.create(model=rollout.model, messages=summary, tools=rollout.tools)


async def asks_again(rollout) -> None:
    """After the tool result, a new user turn: the template then drops the first turn's <think> block
    (it shows reasoning only after the last user query), so the history no longer extends the stream."""
    messages = list(rollout.messages)
    reply = await rollout.client.chat.completions.create(model=rollout.model, messages=messages, tools=rollout.tools)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name, call.function.arguments)}
        )
    messages.append({"role": "user", "content": "Are you sure? Give the final answer."})
    await rollout.client.chat.completions.create(model=rollout.model, messages=messages, tools=rollout.tools)


def forged_outcomes(rollout_id: int) -> list[str]:
    """Lines an agent may print that are valid JSON shaped like the agents' process's outcomes: its own
    rollout's reward, another rollout's failure."""
    return [
        json.dumps({"rollout_id": rollout_id, "reward": 99.0}),
        json.dumps({"rollout_id": rollout_id ^ 1, "error": "forged by a print"}),
    ]


async def noisy(rollout) -> float | None:
    """Prints (plain lines, a line in two writes, lines of valid JSON shaped like outcomes), writes to
    stderr, logs through a `logging` handler of its own and starts a subprocess that prints to the
    stdout it inherits; then runs the calculator's tool loop."""
    rollout_id = rollout.rollout_id
    print(f"a plain line of rollout {rollout_id}")
    print("a line in ", end="")
    await asyncio.sleep(0.01)  # the other rollouts write meanwhile
    print(f"two writes of rollout {rollout_id}")
    for line in forged_outcomes(rollout_id):
        print(line, flush=True)
    print(f"on stderr from rollout {rollout_id}", file=sys.stderr)
    logger = logging.getLogger(f"noisy.{rollout_id}")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())  # made now: it writes to the stderr of this moment
        logger.setLevel(logging.INFO)
    logger.info("logged by rollout %d", rollout_id)
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", f"print('a subprocess of rollout {rollout_id}')")
    await child.wait()
    return await calculator(rollout)


def sleepy_tool(rollout) -> float:
    """A sync agent whose tool takes 2 s, then a line from its thread; no model call (its rows fail for
    that: what the agents' process reports of it is its reward)."""
    time.sleep(2.0)
    print(f"the tool of rollout {rollout.rollout_id} returned")
    return 0.5


async def exits(rollout) -> None:
    """Rollout 1 ends the whole agents' process (exit code 3) after its first call; the others wait."""
    if rollout.rollout_id != 1:
        await asyncio.sleep(3600)
    await rollout.client.chat.completions.create(model=rollout.model, messages=rollout.messages, tools=rollout.tools)
    print("rollout 1 ends the process")
    os._exit(3)


async def says_hello(rollout) -> None:
    """Prints one line and returns without a model call (its rollout fails: no call)."""
    print(f"hello from rollout {rollout.rollout_id}")


def own_connections(rollout) -> float | None:
    """A sync agent whose clients go away: one asks with a wrong key (refused: 401, its rollout goes on),
    one resets its kept-alive connection after a reply, one gives up mid-call (after 10 ms); then the
    calculator's tool loop, with a client of its own for every call, closed after it."""
    with openai.OpenAI(base_url=rollout.base_url, api_key="not-the-key", max_retries=0) as client:
        try:
            client.chat.completions.create(model=rollout.model, messages=rollout.messages)
        except openai.AuthenticationError:
            pass
    _reset_after_models(rollout.base_url, rollout.api_key)
    with openai.OpenAI(base_url=rollout.base_url, api_key=rollout.api_key, timeout=0.01, max_retries=0) as client:
        try:
            client.chat.completions.create(model=rollout.model, messages=rollout.messages, tools=rollout.tools)
        except openai.APITimeoutError:
            pass
    messages = list(rollout.messages)
    for _ in range(3):
        with openai.OpenAI(base_url=rollout.base_url, api_key=rollout.api_key) as client:
            reply = client.chat.completions.create(model=rollout.model, messages=messages, tools=rollout.tools)
        message = reply.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def _reset_after_models(base_url: str, api_key: str) -> None:
    """GET {base_url}/models on a connection of its own, kept alive, then closed with a reset (SO_LINGER
    0), as by a client killed mid-connection."""
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port)) as connection:
        request = f"GET {url.path}/models HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {api_key}\r\n\r\n"
        connection.sendall(request.encode())
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def streams_in_sync(rollout) -> None:
    """The calculator's tool loop as a sync agent with a client of its own that streams every reply and
    builds the assistant message from the chunks."""
    messages = list(rollout.messages)
    with openai.OpenAI(base_url=rollout.base_url, api_key=rollout.api_key) as client:
        for _ in range(8):
            content, calls = "", {}
            chunks = client.chat.completions.create(
                model=rollout.model, messages=messages, tools=rollout.tools, stream=True
            )
            for chunk in chunks:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is None:
                    continue
                content += delta.content or ""
                for piece in delta.tool_calls or []:
                    call = calls.setdefault(piece.index, {"id": "", "type": "function", "name": "", "arguments": ""})
                    call["id"] += piece.id or ""
                    call["name"] += (piece.function and piece.function.name) or ""
                    call["arguments"] += (piece.function and piece.function.arguments) or ""
            tool_calls = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]
            messages.append({"role": "assistant", "content": content, **({"tool_calls": tool_calls} if calls else {})})
            if not calls:
                return None
            for call in calls.values():
                result = run_tool(call["name"], call["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None


async def three_kinds(rollout) -> float | None:
    """By rollout id modulo 3: the calculator's tool loop (examples/agents/openai_loop.py),
    streams_in_sync (in a thread: its client is a sync one) or edits_history, so that the calls of all
    three meet in the same batches (tests/test_agent_determinism.py)."""
    kind = rollout.rollout_id % 3
    if kind == 0:
        return await calculator(rollout)
    if kind == 1:
        return await asyncio.to_thread(streams_in_sync, rollout)
    return await edits_history(rollout)
