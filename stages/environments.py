"""Environments: the tasks an agent is trained on (see docs/extending.md).

An environment is a plain Python class registered in ENVIRONMENTS by name:
    sample_task(rng) -> a task: a JSON-serialisable dict, stored with every row
    reset(task) -> the initial chat messages
    step(task, turn, assistant_text, tool_calls, tool_results, state)
        -> EnvStep(observation, reward, done, stop, state)
    reward(task, final_turn) -> the outcome reward of a rollout that ended naturally
    demonstration(task) -> an expert conversation (used to warm-start the embedded model)
Its tools are named in `tools` and registered in stages.tools.TOOLS (or served by an MCP server).
Environments written for the ecosystem (reasoning-gym, textarena, OpenEnv) are adapted onto this
contract by stages/ecosystem/.

Three stages use it and none owns it: the flow samples tasks and renders `reset` (turn 0),
execute-tools calls `step` (observation, termination), assign-rewards calls `reward`.
A user plugin adds its own (`task.plugins`; tests/plugin_countdown.py is an example).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

SYSTEM_PROMPT = "You are a helpful assistant."


class ReplayError(RuntimeError):
    """An environment made again from its seed and stored actions did not show what it showed the
    first time (the adapters of live games and sessions check every observation's digest)."""


@dataclass
class EnvStep:
    """What the environment answers after one assistant turn."""

    observation: list[dict[str, Any]] = field(default_factory=list)  # chat messages to append
    reward: float = 0.0  # per-turn reward, stored on the turn's row
    done: bool = False  # natural end of the episode
    stop: list[str] | None = None  # stop strings for the next generation
    state: dict[str, Any] | None = None  # the state the next step receives (JSON); None keeps it
    # an environment that runs_tool_calls: (content, None or a failure kind) of each call it was given
    tool_results: list[tuple[str, str | None]] | None = None


class Environment:
    """Base class: a tool-using task where a turn without tool calls is the final answer."""

    name: ClassVar[str]
    tools: ClassVar[tuple[str, ...]] = ()
    max_turns: ClassVar[int] = 4  # assistant turns before a rollout is cut, unless task.max_turns says otherwise
    # True: step() runs the turn's tool calls itself, inside its episode (an OpenEnv MCPEnvironment's
    # tools act on the episode's state), and returns their results in EnvStep.tool_results; its
    # tools are then described by `own_tool_schemas`, not looked up among the registered tools.
    runs_tool_calls: ClassVar[bool] = False
    own_tool_schemas: list[dict[str, Any]] = []

    def identity(self) -> dict[str, Any]:
        """What shapes this environment's behaviour besides its source file (hashed into the versions
        of the stages it shapes, JSON): an adapter's package version and settings. {} for plain code."""
        return {}

    def turn_limit(self, configured: int | None) -> int:
        """Assistant turns before a rollout is cut: task.max_turns when set, else this environment's own."""
        return configured or self.max_turns

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    def step(
        self,
        task: dict[str, Any],
        turn: int,
        assistant_text: str,
        tool_calls: list[dict[str, Any]],
        tool_results: list[str],
        state: dict[str, Any],
    ) -> EnvStep:
        """Default: tool results are the observation; a turn without tool calls is the answer.
        `state` is what the previous step returned as EnvStep.state ({} at turn 0): an
        environment keeps what it learned about the episode there (stored on every row)."""
        if not tool_calls:
            return EnvStep(done=True)
        return EnvStep(observation=[{"role": "tool", "content": result} for result in tool_results])

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        """Outcome reward; final_turn is the last row (content, tool_calls with results, turn)."""
        raise NotImplementedError

    def solved(self, reward: float) -> bool:
        """Did a rollout with this outcome reward succeed (the success rate's count)? Any positive
        reward here; an environment that gives partial credit to failures says where success starts."""
        return reward > 0

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError


def final_answer(text: str) -> str:
    """The visible answer of an assistant turn: what follows the last </think>."""
    return text.rsplit("</think>", 1)[-1].strip()


_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer of the visible answer (after any </think>), if there is one."""
    numbers = _INTEGER.findall(final_answer(text))
    return int(numbers[-1]) if numbers else None


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALCULATOR_QUESTIONS = (
    "Evaluate {expr}.",
    "What is {expr}?",
    "Compute {expr}.",
    "Calculate {expr} for me.",
    "What does {expr} equal?",
    "Please work out {expr}.",
    "Find the value of {expr}.",
    "How much is {expr}?",
)


class CalculatorEnv(Environment):
    """Evaluate `a op b op c` with the calculate tool; reward 1 for the right final number."""

    name = "calculator"
    tools = ("calculate",)

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 99)
        op1, op2 = rng.choice("+-"), rng.choice("+-")
        sep = " " if rng.random() < 0.4 else ""
        expr = f"{a}{sep}{op1}{sep}{b}{sep}{op2}{sep}{c}"
        answer = a + (b if op1 == "+" else -b) + (c if op2 == "+" else -c)
        question = rng.choice(CALCULATOR_QUESTIONS).format(expr=expr)
        return {"question": question, "expression": expr, "answer": answer}

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        return 1.0 if last_integer(final_turn["content"]) == task["answer"] else 0.0

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        expr, answer = task["expression"], task["answer"]
        return self.reset(task) + [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"The user wants {expr}. I will use the calculate tool.",
                "tool_calls": [tool_call("calculate", expression=expr)],
            },
            {"role": "tool", "content": str(answer)},
            {
                "role": "assistant",
                "content": f"The result is {answer}.",
                "reasoning_content": f"The tool returned {answer}.",
            },
        ]


GUESS_RANGE = (1, 100)
GUESS_MAX_TURNS = 50


class GuessNumberEnv(Environment):
    """Find a hidden number with the guess tool (answers: higher, lower, correct). Long
    horizon: the episode ends at the correct guess or at max turns (up to 50); a turn without
    a tool call gives up (the game ends unsolved, as any tool-less turn is a final answer);
    fewer turns, more reward.

    Each answer also states the interval that can still hold the number and its middle
    ("higher: between 51 and 100, middle 75"; the interval is the environment's state), so
    the observation is Markov and bisecting is a copy, not arithmetic (a 1M-parameter model
    cannot compute midpoints; it copies well). What is left to learn is the *choice*:
    guessing the middle solves in at most 7 turns; guessing freely takes longer, and long
    games are where a small model breaks down. The starting policy makes each choice half of
    the time; RL has to find out that the middle pays.

    Per-turn reward: the information a turn's guesses gained, `information_reward` x the
    fraction of log(range size) by which they shrank the interval. It is potential-based
    shaping (Ng et al., 1999; potential = -information_reward x log(interval size) /
    log(range size)): it sums to information_reward for every solved game whatever the path,
    so among solved games the shortest still earns the most, but each turn is credited when
    it happens instead of only at the end of a long episode. A bisecting guess gains the
    most; a guess outside the interval or a malformed call gains nothing.
    """

    name = "guess-number"
    tools = ("guess",)
    max_turns = GUESS_MAX_TURNS
    information_reward = 0.5

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        low, high = GUESS_RANGE
        question = (
            f"I am thinking of a number between {low} and {high}. Find it with the guess tool; "
            "I will answer higher, lower or correct."
        )
        return {"question": question, "secret": rng.randint(low, high)}

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state) -> EnvStep:
        low, high = state.get("low", GUESS_RANGE[0]), state.get("high", GUESS_RANGE[1])
        before = high - low + 1
        observation = []
        for call, result in zip(tool_calls, tool_results):
            if result == "correct":
                low = high = task["secret"]
            elif result in ("higher", "lower"):  # the tool accepted the call: its number is an integer
                if result == "higher":
                    low = max(low, call["arguments"]["number"] + 1)
                else:
                    high = min(high, call["arguments"]["number"] - 1)
                result = f"{result}: between {low} and {high}, middle {(low + high) // 2}"
            observation.append({"role": "tool", "content": result})
        full_range = GUESS_RANGE[1] - GUESS_RANGE[0] + 1
        gained = self.information_reward * math.log(before / (high - low + 1)) / math.log(full_range)
        state = {"low": low, "high": high}
        if "correct" in tool_results or not tool_calls:  # found it, or gave up
            return EnvStep(done=True, reward=gained, state=state)
        return EnvStep(observation=observation, reward=gained, state=state)

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        solved = any(call["result"] == "correct" for call in final_turn["tool_calls"])
        return 1.0 - final_turn["turn"] / GUESS_MAX_TURNS if solved else 0.0

    def demonstration(self, task: dict[str, Any], rng: random.Random | None = None) -> list[dict[str, Any]]:
        """Binary search; with an rng, half of the guesses are random inside the interval
        (the imperfect searcher RL should sharpen). The reasoning copies the interval (and the
        middle) from the last answer and says which of the two it does; answers come from
        self.step."""
        messages, state = self.reset(task), {}
        for turn in range(self.max_turns):
            low, high = state.get("low", GUESS_RANGE[0]), state.get("high", GUESS_RANGE[1])
            if rng is None or rng.random() < 0.5:
                number = (low + high) // 2
                reasoning = f"Between {low} and {high}, I will guess the middle, {number}."
            else:
                number = rng.randint(low, high)
                reasoning = f"Between {low} and {high}, I will guess {number}."
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": reasoning,
                    "tool_calls": [tool_call("guess", number=number)],
                }
            )
            result = "correct" if number == task["secret"] else "higher" if number < task["secret"] else "lower"
            call = {"name": "guess", "arguments": {"number": number}}
            step = self.step(task, turn, "", [call], [result], state)
            if step.done:
                return messages
            messages.extend(step.observation)
            state = step.state
        return messages


WEATHER_CITIES = ("Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Sydney", "Oslo", "Cairo", "Lima")


class WeatherEnv(Environment):
    """Two tools: look up two cities' temperatures (two calls in one turn), then compute the
    difference with the calculator. Each episode has its own weather, so the agent must look."""

    name = "weather"
    tools = ("get_weather", "calculate")

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        first, second = rng.sample(WEATHER_CITIES, 2)
        weather = {city: rng.randint(-5, 35) for city in WEATHER_CITIES}
        question = f"How many degrees celsius warmer is {first} than {second} right now?"
        return {
            "question": question,
            "cities": [first, second],
            "weather": weather,
            "answer": weather[first] - weather[second],
        }

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        return 1.0 if last_integer(final_turn["content"]) == task["answer"] else 0.0

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        (first, second), weather = task["cities"], task["weather"]
        expression = (
            f"{weather[first]}-({weather[second]})" if weather[second] < 0 else f"{weather[first]}-{weather[second]}"
        )
        return self.reset(task) + [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"I need the temperatures of {first} and {second}.",
                "tool_calls": [tool_call("get_weather", location=first), tool_call("get_weather", location=second)],
            },
            {"role": "tool", "content": f"{weather[first]} C"},
            {"role": "tool", "content": f"{weather[second]} C"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"{first} is {weather[first]} C and {second} is {weather[second]} C.",
                "tool_calls": [tool_call("calculate", expression=expression)],
            },
            {"role": "tool", "content": str(task["answer"])},
            {
                "role": "assistant",
                "content": f"{first} is {task['answer']} degrees warmer than {second}.",
                "reasoning_content": f"The tool returned {task['answer']}.",
            },
        ]


ENVIRONMENTS: dict[str, Environment] = {env.name: env for env in (CalculatorEnv(), GuessNumberEnv(), WeatherEnv())}
