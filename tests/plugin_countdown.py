"""A user plugin, as the README shows it: one tool and one environment, registered on import."""

import random

from stages.environments import ENVIRONMENTS, Environment, last_integer
from stages.tools import TOOLS


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


class MultiplyEnv(Environment):
    name = "multiply"
    tools = ("multiply",)

    def sample_task(self, rng: random.Random) -> dict:
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        return {"question": f"What is {a} times {b}?", "answer": a * b}

    def reward(self, task: dict, final_turn: dict) -> float:
        return 1.0 if last_integer(final_turn["content"]) == task["answer"] else 0.0


TOOLS["multiply"] = multiply
ENVIRONMENTS[MultiplyEnv.name] = MultiplyEnv()
