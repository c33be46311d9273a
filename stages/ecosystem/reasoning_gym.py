"""reasoning-gym generators as tasks: `--task reasoning-gym/NAME` (docs/environments.md).

A task is one item of the generator, `reasoning_gym.create_dataset(NAME, size=1, seed=S,
**options)[0]`, with S drawn from the iteration's task seed (`mtrl eval` draws from its own, never
a training iteration's) and the options from task.options["reasoning-gym/NAME"]. The model sees
the item's question and how to mark its answer; a turn without tool calls is its final answer,
and the reward is the package's own scorer, `score_answer(answer, item)` (partial credit
included), on the text between the last <answer> and </answer>. Only S and the question are
stored: the scorer's item is made again from S, and a package that makes another question from it
fails the rollout instead of scoring it against the wrong item.

Demonstrations (`mtrl sft`) answer with the gold answer, after a calculate call where the task offers
the calculator and the item's expression computes to that answer; a generator without gold answers
(only its scorer can grade) has none.
"""

from __future__ import annotations

import functools
import random
from importlib import metadata
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from stages.environments import SYSTEM_PROMPT, Environment, final_answer, tool_call
from stages.tools import calculate

ANSWER_FORMAT = "Put only your final answer between <answer> and </answer>."
# Tools offered by default, by the generator's family (its reasoning_gym subpackage): the
# calculator where the work is arithmetic, the python tool where a program can do it; task.tools
# replaces them.
FAMILY_TOOLS = {
    "arithmetic": ("calculate", "python"),
    "algebra": ("python",),
    "algorithmic": ("python",),
    "graphs": ("python",),
    "games": ("python",),
}
SEEDS = 2**31  # an item's seed is drawn below this (the package seeds random.Random(seed + index))


class ReasoningGymEnv(Environment):
    """One reasoning-gym generator with its options."""

    max_turns = 4  # tool calls, then the answer

    def __init__(self, generator: str, options: dict[str, Any]) -> None:
        if generator not in DATASETS:
            raise ValueError(f"unknown reasoning-gym generator '{generator}'; valid: {', '.join(sorted(DATASETS))}")
        self.generator, self.options = generator, dict(options)
        self.name = f"reasoning-gym/{generator}"
        family = DATASETS[generator][0].__module__.split(".")[1]  # reasoning_gym.FAMILY.module
        self.tools = FAMILY_TOOLS.get(family, ())
        try:
            self.item(0)
        except Exception as exc:  # an unknown option, a value out of range
            raise ValueError(f"{self.name}: its options {self.options} do not make items: {exc}") from None

    def identity(self) -> dict[str, Any]:
        return {"package": f"reasoning-gym=={metadata.version('reasoning-gym')}", "options": self.options}

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one adapter per generator and options, kept for the process)
    def _dataset(self, seed: int) -> Any:
        return reasoning_gym.create_dataset(self.generator, size=1, seed=seed, **self.options)

    def item(self, seed: int) -> dict[str, Any]:
        """The generator's item of this seed: {question, answer, metadata}."""
        return self._dataset(seed)[0]

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        seed = rng.randrange(SEEDS)
        item = self.item(seed)
        return {"seed": seed, "question": item["question"], "answer": item["answer"]}

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        question = f"{task['question'].rstrip()}\n\n{ANSWER_FORMAT}"
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        item = self.item(task["seed"])
        if item["question"] != task["question"]:
            raise ValueError(
                f"{self.name} made another question from seed {task['seed']} than the stored one (another package "
                "version, or a generator that is not deterministic): the stored answer cannot be scored"
            )
        answer = extract_answer(final_answer(final_turn["content"]))
        score = self._dataset(task["seed"]).score_answer
        try:
            return float(score(answer, item))
        except Exception:
            # A few scorers raise on an answer they cannot parse (prime_factorization: int() of the
            # text) where the others return 0: that answer scores 0, provided the scorer grades its
            # own gold answer (one that cannot is broken, and the rollout fails, flagged).
            if item["answer"] is None:
                raise
            score(item["answer"], item)
            return 0.0

    def solved(self, reward: float) -> bool:
        return reward >= 1.0  # full credit: some scorers give partial credit to wrong answers

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The gold answer between the tags; first a calculate call on the item's expression where
        the task offers the calculator and it computes the gold answer from it (the arithmetic
        generators: basic_arithmetic, chain_sum, products, ...), so that a warm start shows the tool
        in use where it helps."""
        if task["answer"] is None:
            raise ValueError(f"{self.name} has no gold answers (only its scorer grades): no demonstrations")
        answer = {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}
        expression = self.item(task["seed"])["metadata"].get("expression")
        if "calculate" not in self.tools or not isinstance(expression, str):
            return [*self.reset(task), answer]
        try:
            computed = calculate(expression)
        except ValueError:  # beyond what the calculator evaluates
            computed = None
        if computed != task["answer"]:
            return [*self.reset(task), answer]
        call = {"role": "assistant", "content": "", "tool_calls": [tool_call("calculate", expression=expression)]}
        return [*self.reset(task), call, {"role": "tool", "content": computed}, answer]
