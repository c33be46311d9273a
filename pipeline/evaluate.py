"""Rollouts in-process, without Prefect or the store: a plain loop over the same stage
functions the flow runs (`mtrl eval`, the embedded model's build, tests, notebooks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets

from pipeline.task_mix import rollout_starts, turn_limit
from schemas.config import RunConfig
from stages import assign_rewards, execute_tools, generate_rollouts
from stages.environments import ENVIRONMENTS
from stages.generate_rollouts.engine import GenerationEngine


def generate_turn(
    engine: GenerationEngine,
    tokenizer: Any,
    config: RunConfig,
    *,
    iteration: int,
    turn: int,
    policy_version: str,
    history: datasets.Dataset | None,
    report_progress: Callable[[float], None] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any] | None]:
    """generate-rollouts for one turn, configured by the run config (and the engine's replay)."""
    return generate_rollouts.generate_rollouts(
        engine,
        tokenizer,
        config=config.generation,
        seed=config.seed,
        iteration=iteration,
        turn=turn,
        policy_version=policy_version,
        starts=rollout_starts(config, iteration) if turn == 0 else None,
        history=history,
        report_progress=report_progress,
    )


def execute_turn(turns: datasets.Dataset, tokenizer: Any, config: RunConfig) -> datasets.Dataset:
    """execute-tools for one turn, with the registered environments and tools."""
    return execute_tools.execute_tools(
        turns,
        tokenizer,
        ENVIRONMENTS,
        execute_tools.TOOLS,
        task_config=config.task,
        tools_config=config.tools,
        generation_config=config.generation,
        max_workers=config.runner.max_workers,
    )


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
    return assign_rewards.assign_rewards(datasets.concatenate_datasets(rounds), ENVIRONMENTS, config.reward)
