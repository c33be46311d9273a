"""Rollouts without Prefect or the store: the iteration's tasks, and a plain loop over turns.

The flow (pipeline/flows.py) runs the same stage functions as versioned Prefect tasks; this
module is for evaluating a model in-process (the embedded model's build, tests, notebooks).
"""

from __future__ import annotations

import json
import random
from typing import Any

import datasets
import numpy as np

from schemas.config import RunConfig
from schemas.features import token_counts
from stages import assign_rewards, execute_tools, generate_rollouts


def rollout_starts(config: RunConfig, iteration: int) -> list[dict[str, Any]]:
    """The iteration's tasks: rollouts / group_size tasks, each sampled group_size times."""
    if config.task.name not in assign_rewards.ENVIRONMENTS:
        raise ValueError(f"unknown task '{config.task.name}'; valid: {', '.join(assign_rewards.ENVIRONMENTS)}")
    environment = assign_rewards.ENVIRONMENTS[config.task.name]
    tools = [execute_tools.tool_schema(execute_tools.TOOLS[name]) for name in environment.tools]
    rng = random.Random(f"tasks/{config.seed}/{iteration}")
    starts = []
    for group_id in range(config.task.rollouts // config.task.group_size):
        task = environment.sample_task(rng)
        for _ in range(config.task.group_size):
            starts.append(
                {
                    "rollout_id": len(starts),
                    "group_id": group_id,
                    "task": environment.name,
                    "task_id": f"{environment.name}-{iteration}-{group_id}",
                    "task_payload": json.dumps(task, sort_keys=True),
                    "messages": environment.reset(task),
                    "tools": tools,
                }
            )
    return starts


def run_episodes(
    engine: generate_rollouts.Engine, tokenizer: Any, config: RunConfig, iteration: int = 0
) -> datasets.Dataset:
    """All turns of one iteration's rollouts, scored: the assign-rewards dataset, in memory."""
    rounds: list[datasets.Dataset] = []
    for turn in range(config.task.max_turns):
        generated = generate_rollouts.generate_rollouts(
            engine,
            tokenizer,
            config=config.generation,
            seed=config.seed,
            iteration=iteration,
            turn=turn,
            policy_version="in-memory",
            starts=rollout_starts(config, iteration) if turn == 0 else None,
            history=datasets.concatenate_datasets(rounds) if rounds else None,
        )
        rounds.append(
            execute_tools.execute_tools(
                generated,
                tokenizer,
                assign_rewards.ENVIRONMENTS,
                execute_tools.TOOLS,
                task_config=config.task,
                tools_config=config.tools,
                generation_config=config.generation,
                max_workers=config.runner.max_workers,
            )
        )
        if all(stop is not None for stop in rounds[-1]["stop_reason"]):
            break
    return assign_rewards.assign_rewards(
        datasets.concatenate_datasets(rounds), assign_rewards.ENVIRONMENTS, config.reward
    )


# ---------------------------------------------------------------------------------------


def rollout_metrics(turns: datasets.Dataset) -> dict[str, Any]:
    """Per-iteration rollout metrics (NeMo-RL's names where they exist)."""
    columns = turns.select_columns(["rollout_id", "turn", "stop_reason", "failed", "reward"]).to_dict()
    last: dict[int, dict[str, Any]] = {}
    for rollout_id, turn_, stop, failed, reward in zip(*columns.values()):
        if rollout_id not in last or turn_ >= last[rollout_id]["turn"]:
            last[rollout_id] = {"turn": turn_, "stop": stop, "failed": failed, "reward": reward}
    n = max(1, len(last))
    scored = [r["reward"] for r in last.values() if not r["failed"]]
    tokens = token_counts(turns)
    return {
        "rollouts": len(last),
        "reward_mean": float(np.mean(scored)) if scored else None,
        "success_rate": float(np.mean([r > 0 for r in scored])) if scored else None,
        "natural_termination_rate": sum(r["stop"] == "done" for r in last.values()) / n,
        "truncation_rate": sum(r["stop"] in ("context_overflow", "length") for r in last.values()) / n,
        "max_turns_reached_rate": sum(r["stop"] == "max_turns" for r in last.values()) / n,
        "failed_rate": sum(bool(r["failed"]) for r in last.values()) / n,
        "mean_turns": float(np.mean([r["turn"] + 1 for r in last.values()])) if last else 0.0,
        "max_turns": max((r["turn"] + 1 for r in last.values()), default=0),
        "mean_gen_tokens_per_rollout": tokens.get("completion", 0) / n,
        "mean_env_tokens_per_rollout": tokens.get("observation", 0) / n,
    }
