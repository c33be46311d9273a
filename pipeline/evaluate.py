"""Rollouts in-process, without Prefect or the store: a plain loop over the same turn functions
the flow runs (`mtrl eval`, the embedded model's build, tests, notebooks)."""

from __future__ import annotations

from typing import Any

import datasets

from schemas.config import RunConfig
from stages import assign_rewards
from stages.execute_tools import execute_turn
from stages.generate_rollouts import generate_turn
from stages.generate_rollouts.engine import GenerationEngine
from stages.registry import environments
from stages.task_mix import turn_limit


def run_episodes(engine: GenerationEngine, tokenizer: Any, config: RunConfig, iteration: int = 0) -> datasets.Dataset:
    """All turns of one iteration's rollouts, scored: the assign-rewards dataset, in memory."""
    rounds: list[datasets.Dataset] = []
    for turn in range(turn_limit(config)):
        history = datasets.concatenate_datasets(rounds) if rounds else None
        generated, _ = generate_turn(
            engine, tokenizer, config, iteration=iteration, turn=turn, policy_version="in-memory", history=history
        )
        rounds.append(execute_turn(generated, tokenizer, config))
        if all(stop is not None for stop in rounds[-1]["stop_reason"]):
            break
    return assign_rewards.assign_rewards(datasets.concatenate_datasets(rounds), environments(config), config.reward)
