"""The calculator taskset: one task per rollout, its question and answer handed in by the caller."""

from __future__ import annotations

import re

import verifiers.v1 as vf

from .tools import CalculatorToolset

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer of the visible answer (after any </think>), as mtrl's calculator reads it."""
    numbers = _INTEGER.findall(text.rsplit("</think>", 1)[-1])
    return int(numbers[-1]) if numbers else None


class CalculatorData(vf.TaskData):
    answer: int
    """The value of the expression the question asks for."""


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last integer of the final answer is the answer, else 0."""
        return 1.0 if last_integer(trace.last_reply) == self.data.answer else 0.0


class CalculatorConfig(vf.TasksetConfig):
    question: str = "What is 12+7-3?"
    answer: int = 16
    system_prompt_text: str | None = "You are a helpful assistant."
    """The system message (mtrl's calculator task has one); None for none."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self) -> list[CalculatorTask]:
        data = CalculatorData(
            prompt=self.config.question,
            system_prompt=self.config.system_prompt_text,
            answer=self.config.answer,
        )
        return [CalculatorTask(data, self.config.task)]

    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]
