"""The plugin and the agent of bench/agents.py (ii): guess-number with a slow `guess` tool, played by
the native lock-step loop and by an agent program that runs on its own.

    task.plugins = ["bench.agent_bench_tasks"], task.name = "slow-guess"          the native loop
    agent.function = "bench.agent_bench_tasks:play"  (with the same plugin and task)   the agent

The tool answers as stages/tools.py's `guess` after a latency of 0-2 s that is a function of the
game and the guess (`latency`), so both paths wait the same for the same call. `slow-guess` is
guess-number under another name, with the same prompts; the tool keeps its name and docstring, so
the model sees the schema it knows (importing this module makes TOOLS["guess"] the slow one).

The agent plays the game as the native loop does: the task's own messages and tool schemas, the
same tool (awaited: an async agent awaits its I/O), the environment's step() for the observation
text and the end of the game, and native execute-tools' error texts for calls it would refuse. It
returns the environment's reward itself: the result of the last call's tools is not recorded by
the endpoint (the next call would record it), so None would score a solved game 0.

This module is loaded by the tool workers (stages/execute_tools/worker.py): it imports only light
modules at import time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from stages import tools as builtin
from stages.environments import ENVIRONMENTS, GUESS_MAX_TURNS, GuessNumberEnv
from stages.tools import TOOLS

MAX_LATENCY_S = 2.0


def latency(task: dict[str, Any], number: Any) -> float:
    """Seconds the tool takes to answer this guess in this game: uniform in [0, MAX_LATENCY_S),
    seeded by the game and the guess (the same in both paths, whatever the batch or the clock)."""
    return random.Random(f"{json.dumps(task, sort_keys=True)}/{number!r}").uniform(0.0, MAX_LATENCY_S)


def guess(number: int, task: dict) -> str:
    """Guess the hidden number; the answer is higher, lower or correct.

    Args:
        number: Your guess.
        task: The episode's hidden state (filled in by the environment, not by the model).
    """
    time.sleep(latency(task, number))
    return builtin.guess(number, task)


async def guess_awaited(number: int, task: dict) -> str:
    """The same tool for an async agent: the same latency, awaited."""
    await asyncio.sleep(latency(task, number))
    return builtin.guess(number, task)


class SlowGuessEnv(GuessNumberEnv):
    """guess-number (the same prompts, steps and reward) whose `guess` tool is slow."""

    name = "slow-guess"


TOOLS["guess"] = guess
ENVIRONMENTS[SlowGuessEnv.name] = SlowGuessEnv()


async def _results(calls: list[Any], schemas: dict[str, dict[str, Any]], task: dict[str, Any]) -> list[str]:
    """Each call's result as native execute-tools gives it: its error text when it would refuse the
    call (malformed, unknown tool, arguments off the schema), else the tool's answer; concurrently."""
    from stages.execute_tools.calls import rejected_call  # heavy: not for the tool workers

    async def one(call: Any) -> str:
        rejected = rejected_call(call, schemas)
        if rejected is not None:
            return rejected.content
        try:
            return str(await guess_awaited(**call.arguments, task=task))
        except Exception as exc:  # as a tool that raises natively: the model reads the error
            return f"Error: {exc.__class__.__name__}: {exc}"

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def play(rollout: Any) -> float | None:
    """One game of slow-guess against mtrl's endpoint: ask, run the guesses, step the environment,
    ask again with its observation, until the game ends; returns the environment's reward."""
    import openai

    from stages.hermes import ToolCall, parse_tool_calls

    environment = ENVIRONMENTS[SlowGuessEnv.name]
    task, state = rollout.task, {}
    schemas = {tool["function"]["name"]: tool for tool in rollout.tools}
    messages = list(rollout.messages)
    for turn in range(GUESS_MAX_TURNS + 1):  # the call past the turn limit is refused: the rollout is cut
        try:
            reply = await rollout.client.chat.completions.create(
                model=rollout.model, messages=messages, tools=rollout.tools
            )
        except openai.BadRequestError:  # the call limit (cut at max_turns) or the context budget
            return None
        choice = reply.choices[0]
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if choice.finish_reason == "length":  # cut mid-answer: nothing to run (natively: overlong)
            return None
        content = message.content or ""
        if message.tool_calls:  # all well formed (the endpoint returns none when one is not)
            calls = [
                ToolCall(call.function.name, json.loads(call.function.arguments), None, call.id)
                for call in message.tool_calls
            ]
        else:  # a malformed block comes back as text: the native loop answers its calls with errors
            calls = parse_tool_calls(content)
        results = await _results(calls, schemas, task)
        given = [{"name": call.name, "arguments": call.arguments} for call in calls]
        step = environment.step(task, turn, content, given, results, state)
        state = step.state if step.state is not None else state
        if step.done:  # found it, or gave up (no tool call)
            return environment.reward(task, {"turn": turn, "tool_calls": [{"result": r} for r in results]})
        for call, observed in zip(calls, step.observation):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": observed["content"]})
    return None


def calculator_over_httpx(rollout: Any) -> None:
    """The calculator's tool loop (examples/agents/openai_loop.py) as a plain sync agent with its own
    httpx.Client and no openai library: what bench/agents.py's scale part runs 1,024 of at once
    (agent.concurrency 0: a thread each)."""
    import httpx

    from examples.agents.openai_loop import MAX_CALLS, run_tool

    messages = list(rollout.messages)
    headers = {"Authorization": f"Bearer {rollout.api_key}"}
    with httpx.Client(base_url=rollout.base_url, headers=headers, timeout=600) as client:
        for _ in range(MAX_CALLS):
            reply = client.post(
                "/chat/completions", json={"model": rollout.model, "messages": messages, "tools": rollout.tools}
            )
            reply.raise_for_status()
            message = reply.json()["choices"][0]["message"]
            messages.append({key: value for key, value in message.items() if value is not None})
            if not message.get("tool_calls"):
                return None
            for call in message["tool_calls"]:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None
