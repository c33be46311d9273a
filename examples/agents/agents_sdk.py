"""The calculator task as an OpenAI Agents SDK agent, on the Responses API (`responses`) and on chat
completions (`chat_completions`):

    mtrl run --agent examples.agents.agents_sdk:responses
    mtrl run --agent examples.agents.agents_sdk:responses_streamed
    mtrl run --agent examples.agents.agents_sdk:chat_completions

The task's tools become the SDK's function tools with the task's own JSON schemas, so the policy sees
the prompt it was warm-started on. The SDK's tracing posts to its vendor's host: it is turned off
here (and mtrl sets OPENAI_AGENTS_DISABLE_TRACING=1 for every agent it runs).
"""

from __future__ import annotations

import json
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)

from stages.tools import TOOLS

MAX_TURNS = 8  # the SDK's own limit; mtrl cuts the rollout at its call limit first


def function_tool(schema: dict[str, Any]) -> FunctionTool:
    """A task's tool (its OpenAI function schema) as an SDK tool that runs it here."""
    function = schema["function"]

    async def invoke(context: Any, arguments: str) -> str:
        try:
            return str(TOOLS[function["name"]](**json.loads(arguments)))
        except Exception as exc:  # the model reads the error and may try again
            return f"Error: {exc}"

    return FunctionTool(
        name=function["name"],
        description=function.get("description", ""),
        params_json_schema=function["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


async def _run(rollout, model, streamed: bool = False) -> None:
    set_tracing_disabled(True)
    instructions = next(m["content"] for m in rollout.messages if m["role"] == "system")
    question = next(m["content"] for m in rollout.messages if m["role"] == "user")
    tools = [function_tool(schema) for schema in rollout.tools]
    calculator = Agent(name="calculator", instructions=instructions, tools=tools, model=model)
    if streamed:  # the events as they come (a UI would show them); the run is the same
        async for _ in Runner.run_streamed(calculator, question, max_turns=MAX_TURNS).stream_events():
            pass
    else:
        await Runner.run(calculator, question, max_turns=MAX_TURNS)
    return None  # the task's reward of the final answer


async def responses(rollout) -> None:
    """The SDK's default: the Responses API, the whole history sent every turn."""
    return await _run(rollout, OpenAIResponsesModel(model=rollout.model, openai_client=rollout.client))


async def responses_streamed(rollout) -> None:
    """The Responses API streamed (Runner.run_streamed)."""
    return await _run(rollout, OpenAIResponsesModel(model=rollout.model, openai_client=rollout.client), streamed=True)


async def chat_completions(rollout) -> None:
    return await _run(rollout, OpenAIChatCompletionsModel(model=rollout.model, openai_client=rollout.client))
