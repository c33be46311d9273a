"""Agent programs the agent tests run (tests/test_agents.py): each misbehaves on the odd rollouts in
one way and runs the calculator's tool loop (examples/agents/openai_loop.py) on the others."""

from __future__ import annotations

import asyncio
import time

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
