"""A task mix: the environments of a run and their weights ('calculator', 'calculator:3,weather:1'),
and how an iteration's groups are split over them. Read by the run config (to validate it) and by
the stages (to sample tasks), so it sits here, below both."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def parse_task_mix(name: str) -> list[tuple[str, float]]:
    """(environment, weight) pairs of a task mix such as 'calculator:3,weather:1'; weights default to 1."""
    pairs = []
    for part in name.split(","):
        env, _, weight = part.strip().partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"task '{part}': the weight after ':' must be a number") from None
        if not env or value <= 0:
            raise ValueError(f"task '{part}': expected NAME or NAME:WEIGHT with a positive weight")
        pairs.append((env, value))
    return pairs


def groups_per_task(pairs: list[tuple[str, float]], groups: int) -> list[str]:
    """The environment of each of `groups` groups: the weights split them by largest remainder."""
    total = sum(weight for _, weight in pairs)
    exact = [groups * weight / total for _, weight in pairs]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(pairs)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: groups - sum(counts)]:
        counts[i] += 1
    return [env for (env, _), count in zip(pairs, counts) for _ in range(count)]


# A settings field holding a task mix as its (environment, weight) pairs, read from its text.
TaskMix = Annotated[list[tuple[str, float]], BeforeValidator(lambda v: parse_task_mix(v) if isinstance(v, str) else v)]
