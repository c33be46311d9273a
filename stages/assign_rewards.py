"""assign-rewards: environments (tasks, termination, rewards) and the stage that scores
finished rollouts.

An environment is a plain Python class:
    sample_task(rng) -> task dict (JSON-serialisable, stored with every row)
    reset(task) -> the initial chat messages
    step(task, turn, assistant_text, tool_calls, tool_results) -> EnvStep(observation, reward, done)
    reward(task, final_text) -> the outcome reward of a rollout that ended naturally
    demonstration(task) -> an expert conversation (used to warm-start the embedded model)
Tools are named here and implemented in stages/execute_tools.py.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import datasets

from schemas.config import RewardConfig
from schemas.features import ASSIGN_REWARDS, sort_turns

SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass
class EnvStep:
    """What the environment answers after one assistant turn."""

    observation: list[dict[str, Any]] = field(default_factory=list)  # chat messages to append
    reward: float = 0.0  # per-turn reward, stored on the turn's row
    done: bool = False  # natural end of the episode


class Environment:
    """Base class: a tool-using task where a turn without tool calls is the final answer."""

    name: ClassVar[str]
    tools: ClassVar[tuple[str, ...]] = ()

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
    ) -> EnvStep:
        if not tool_calls:
            return EnvStep(done=True)
        return EnvStep(observation=[{"role": "tool", "content": result} for result in tool_results])

    def reward(self, task: dict[str, Any], final_text: str) -> float:
        raise NotImplementedError

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError


def final_answer(text: str) -> str:
    """The visible answer of an assistant turn: what follows the last </think>."""
    return text.rsplit("</think>", 1)[-1].strip()


_INTEGER = re.compile(r"-?\d+")

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

    def reward(self, task: dict[str, Any], final_text: str) -> float:
        numbers = _INTEGER.findall(final_answer(final_text))
        return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        expr, answer = task["expression"], task["answer"]
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expr}}}
        return self.reset(task) + [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"The user wants {expr}. I will use the calculate tool.",
                "tool_calls": [call],
            },
            {"role": "tool", "content": str(answer)},
            {
                "role": "assistant",
                "content": f"The result is {answer}.",
                "reasoning_content": f"The tool returned {answer}.",
            },
        ]


ENVIRONMENTS: dict[str, Environment] = {env.name: env for env in (CalculatorEnv(),)}


# ---------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------


def assign_rewards(
    turns: datasets.Dataset, environments: dict[str, Environment], config: RewardConfig
) -> datasets.Dataset:
    """Score every finished rollout and put its final reward on each of its rows.

    Natural end: the environment's outcome reward of the final answer. Cut by max turns,
    context overflow or length: `config.truncated_reward`. Failed (infrastructure): NaN,
    and the rollout stays flagged, so it is never mistaken for a scored 0.
    """
    turns = sort_turns(turns)
    columns = turns.select_columns(["rollout_id", "task", "task_payload", "content", "stop_reason", "failed"])
    final_reward: dict[int, float] = {}
    for row in columns:  # sorted by turn: the last row seen for a rollout is its end
        if row["failed"]:
            final_reward[row["rollout_id"]] = math.nan
        elif row["stop_reason"] == "done":
            task = json.loads(row["task_payload"])
            final_reward[row["rollout_id"]] = float(environments[row["task"]].reward(task, row["content"]))
        elif row["stop_reason"] is not None:
            final_reward[row["rollout_id"]] = config.truncated_reward
        else:
            final_reward.pop(row["rollout_id"], None)
    unfinished = sorted(set(columns["rollout_id"]) - set(final_reward))
    if unfinished:
        raise ValueError(f"rollouts {unfinished[:5]} have not finished: run all their turns first")
    rewards = [final_reward[r] for r in columns["rollout_id"]]
    return turns.add_column("reward", rewards, feature=ASSIGN_REWARDS["reward"])
