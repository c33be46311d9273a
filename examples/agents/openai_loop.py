"""The calculator task as an agent program written with the openai client: a plain tool loop.

    mtrl run --agent examples.agents.openai_loop:agent

mtrl calls `agent` once per rollout with an AgentRollout: the task (its question), the task's own
first messages and tool schemas, and an OpenAI-compatible endpoint of the rollout's own
(`rollout.client`, or `rollout.base_url` and `rollout.api_key` for any other client). The agent runs
the tools itself; mtrl records every token the policy saw and sampled on its side.
"""

from __future__ import annotations

import json

from stages.tools import calculate

MAX_CALLS = 8  # mtrl cuts a rollout at its call limit (agent.max_calls, else the task's turn limit)


def run_tool(name: str, arguments: str) -> str:
    """The agent's own tools: here the calculator's."""
    try:
        if name != "calculate":
            return f"Error: unknown tool {name}"
        return calculate(**json.loads(arguments))
    except Exception as exc:  # the model reads the error and may try again
        return f"Error: {exc}"


async def agent(rollout) -> float | None:
    """Ask, run the tool calls the model makes, ask again, until it answers without one. Returns None:
    the task's reward of the final answer (mtrl's assign-rewards applies it, and can re-apply it)."""
    messages = list(rollout.messages)
    for _ in range(MAX_CALLS):
        reply = await rollout.client.chat.completions.create(
            model=rollout.model, messages=messages, tools=rollout.tools
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
