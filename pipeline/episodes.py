"""Rollouts without Prefect or the store: the iteration's tasks, and a plain loop over turns.

The flow (pipeline/flows.py) runs the same stage functions as versioned Prefect tasks; this
module is for evaluating a model in-process (the embedded model's build, tests, notebooks).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys
from typing import Any

import datasets
import numpy as np

from pipeline.stage_table import source_version
from schemas.config import RunConfig
from schemas.features import StopReason
from schemas.token_stream import rollouts
from stages import assign_rewards, execute_tools, generate_rollouts


def load_plugins(modules: list[str]) -> None:
    """Import user modules that register tools (TOOLS) and environments (ENVIRONMENTS); the
    working directory is searched first, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        importlib.import_module(module)


def environment_code(config: RunConfig) -> dict[str, str]:
    """Code version of each environment of the task mix and of its tools: a hash of the source
    files that define them, so editing a reward function or a tool gives new versions."""
    versions = {}
    for name, _ in config.task.mix():
        environment = assign_rewards.ENVIRONMENTS[name]
        files = {inspect.getsourcefile(type(environment))}
        files |= {inspect.getsourcefile(execute_tools.TOOLS[tool]) for tool in environment.tools}
        versions[name] = source_version(*sorted(files))
    return versions


def task_turn_limits(config: RunConfig) -> dict[str, int]:
    """Each task's turn limit: task.max_turns, or its environment's own."""
    return {name: assign_rewards.ENVIRONMENTS[name].turn_limit(config.task.max_turns) for name, _ in config.task.mix()}


def turn_limit(config: RunConfig) -> int:
    """Rounds of an iteration at most: the longest turn limit of the mix (each rollout is
    still cut at its own task's limit)."""
    return max(task_turn_limits(config).values())


def check_environments(config: RunConfig) -> None:
    """Every task of the mix is registered, has tools, and its tools are registered."""
    for name, _ in config.task.mix():
        if name not in assign_rewards.ENVIRONMENTS:
            raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(assign_rewards.ENVIRONMENTS))}")
        environment = assign_rewards.ENVIRONMENTS[name]
        if not environment.tools:
            raise ValueError(f"environment '{name}' lists no tools; a tool-using task needs at least one")
        missing = [tool for tool in environment.tools if tool not in execute_tools.TOOLS]
        if missing:
            raise ValueError(
                f"environment '{name}' uses unregistered tool(s) {missing}; registered: {', '.join(execute_tools.TOOLS)}"
            )


def rollout_starts(config: RunConfig, iteration: int) -> list[dict[str, Any]]:
    """The iteration's tasks: rollouts / group_size groups, each one task of one environment
    (split by the task mix) sampled group_size times. A group never mixes tasks."""
    check_environments(config)
    rng = random.Random(f"tasks/{config.seed}/{iteration}")
    starts = []
    for group_id, name in enumerate(config.task.groups_per_task()):
        environment = assign_rewards.ENVIRONMENTS[name]
        tools = [execute_tools.tool_schema(execute_tools.TOOLS[tool]) for tool in environment.tools]
        try:
            task = environment.sample_task(rng)
            messages = environment.reset(task)
            json.dumps(task)
        except Exception as exc:
            raise ValueError(f"environment '{name}' failed to start a task: {exc.__class__.__name__}: {exc}") from exc
        for _ in range(config.task.group_size):
            starts.append(
                {
                    "rollout_id": len(starts),
                    "group_id": group_id,
                    "task": environment.name,
                    "task_id": f"{environment.name}-{iteration}-{group_id}",
                    "task_payload": json.dumps(task, sort_keys=True),
                    "messages": messages,
                    "tools": tools,
                }
            )
    return starts


def generate_turn(
    engine: generate_rollouts.Engine,
    tokenizer: Any,
    config: RunConfig,
    *,
    iteration: int,
    turn: int,
    policy_version: str,
    history: datasets.Dataset | None,
) -> datasets.Dataset:
    """generate-rollouts for one turn, configured by the run config."""
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
    )


def execute_turn(turns: datasets.Dataset, tokenizer: Any, config: RunConfig) -> datasets.Dataset:
    """execute-tools for one turn, with the registered environments and tools."""
    return execute_tools.execute_tools(
        turns,
        tokenizer,
        assign_rewards.ENVIRONMENTS,
        execute_tools.TOOLS,
        task_config=config.task,
        tools_config=config.tools,
        generation_config=config.generation,
        max_workers=config.runner.max_workers,
    )


def run_episodes(
    engine: generate_rollouts.Engine, tokenizer: Any, config: RunConfig, iteration: int = 0
) -> datasets.Dataset:
    """All turns of one iteration's rollouts, scored: the assign-rewards dataset, in memory."""
    rounds: list[datasets.Dataset] = []
    for turn in range(turn_limit(config)):
        history = datasets.concatenate_datasets(rounds) if rounds else None
        generated = generate_turn(
            engine, tokenizer, config, iteration=iteration, turn=turn, policy_version="in-memory", history=history
        )
        rounds.append(execute_turn(generated, tokenizer, config))
        if all(stop is not None for stop in rounds[-1]["stop_reason"]):
            break
    return assign_rewards.assign_rewards(
        datasets.concatenate_datasets(rounds), assign_rewards.ENVIRONMENTS, config.reward
    )


def rollout_metrics(turns: datasets.Dataset, turn_limits: dict[str, int]) -> dict[str, Any]:
    """Per-iteration rollout metrics (NeMo-RL's names where they exist), overall and per task.

    Turns to solve, two ways: `mean_turns_to_solve` averages the solved rollouts only (it can
    rise while a policy gets better, by solving harder cases too); `mean_turns_to_solve_or_limit`
    counts an unsolved rollout as its task's turn limit (`turn_limits`), a censored mean that
    falls only if rollouts solve more often or sooner. Failed rollouts count in neither."""
    columns = turns.select_columns(["task", "stop_reason", "failed", "reward"]).to_dict()
    everything: list[dict[str, Any]] = []  # one summary per rollout
    for rollout in rollouts(turns):
        end = rollout.rows[-1]  # the last turn says how the rollout ended
        everything.append(
            {
                "task": columns["task"][end],
                "turn": rollout.turns[-1],
                "stop": columns["stop_reason"][end],
                "failed": columns["failed"][end],
                "reward": columns["reward"][end],
                "gen": sum(stop - start for start, stop in rollout.completion_spans),
                "env": sum(stop - start for start, stop in rollout.observation_spans),
            }
        )

    def summary(group: list[dict[str, Any]]) -> dict[str, Any]:
        n = max(1, len(group))
        scored = [r["reward"] for r in group if not r["failed"]]
        solved = [r["turn"] + 1 for r in group if r["stop"] == StopReason.DONE and not r["failed"] and r["reward"] > 0]
        censored = [
            r["turn"] + 1 if r["stop"] == StopReason.DONE and r["reward"] > 0 else turn_limits[r["task"]]
            for r in group
            if not r["failed"]
        ]
        return {
            "rollouts": len(group),
            "reward_mean": float(np.mean(scored)) if scored else None,
            "success_rate": float(np.mean([r > 0 for r in scored])) if scored else None,
            "natural_termination_rate": sum(r["stop"] == StopReason.DONE for r in group) / n,
            "truncation_rate": sum(r["stop"] in (StopReason.CONTEXT_OVERFLOW, StopReason.LENGTH) for r in group) / n,
            "max_turns_reached_rate": sum(r["stop"] == StopReason.MAX_TURNS for r in group) / n,
            "failed_rate": sum(bool(r["failed"]) for r in group) / n,
            "mean_turns": float(np.mean([r["turn"] + 1 for r in group])) if group else 0.0,
            "max_turns": max((r["turn"] + 1 for r in group), default=0),
            "mean_turns_to_solve": float(np.mean(solved)) if solved else None,
            "mean_turns_to_solve_or_limit": float(np.mean(censored)) if censored else None,
            "mean_gen_tokens_per_rollout": sum(r["gen"] for r in group) / n,
            "mean_env_tokens_per_rollout": sum(r["env"] for r in group) / n,
        }

    tasks = sorted({r["task"] for r in everything})
    return {**summary(everything), "per_task": {t: summary([r for r in everything if r["task"] == t]) for t in tasks}}
