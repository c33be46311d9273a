"""The turn loop of an iteration, and rollouts in-process with it, without Prefect or the store
(`mtrl eval`, the embedded model's build, tests, notebooks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import datasets

from schemas.config import RunConfig
from stages import assign_rewards
from stages.execute_tools import active_rollouts, execute_turn
from stages.generate_rollouts import generate_turn
from stages.generate_rollouts.engine import GenerationEngine
from stages.registry import run_environments
from stages.task_mix import turn_limit

Turn = TypeVar("Turn")


def play_turns(config: RunConfig, play_turn: Callable[[int, Turn | None], tuple[Turn, int]]) -> list[Turn]:
    """The turns of an iteration's rollouts: play_turn(turn, previous turn) generates and executes
    turn 0, 1, ... and returns it with its count of rollouts still active, until none is or the
    run's turn limit is reached (the flow's experience and run_episodes below share this loop)."""
    played: list[Turn] = []
    for turn in range(turn_limit(config)):
        made, active = play_turn(turn, played[-1] if played else None)
        played.append(made)
        if active == 0:
            break
    return played


def run_episodes(engine: GenerationEngine, tokenizer: Any, config: RunConfig, iteration: int = 0) -> datasets.Dataset:
    """All turns of one iteration's rollouts, scored: the assign-rewards dataset, in memory."""

    def play_turn(turn: int, previous: datasets.Dataset | None) -> tuple[datasets.Dataset, int]:
        generated, _ = generate_turn(
            engine, tokenizer, config, iteration=iteration, turn=turn, policy_version="in-memory", history=previous
        )
        executed = execute_turn(generated, tokenizer, config)
        history = executed if previous is None else datasets.concatenate_datasets([previous, executed])
        return history, active_rollouts(executed)

    turns = play_turns(config, play_turn)[-1]
    return assign_rewards.assign_rewards(turns, run_environments(config), config.reward)
