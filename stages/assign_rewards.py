"""assign-rewards: score every finished rollout with its environment's reward, and summarise
the iteration's rollouts (success, turns, termination, tokens: the rollout metrics).

It reads the whole iteration (every turn of its rollouts) once, from the last turn's execute-tools
version. The environments themselves (tasks, steps, rewards) are stages/environments.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

import datasets
import numpy as np

from runtime.phases import PHASES
from schemas.features import ASSIGN_REWARDS, StopReason, agent_state
from schemas.stage import Inputs, Output, Settings, Stage, read
from schemas.token_stream import rollouts
from stages.environments import Environment
from stages.registry import Tasks


class RewardSettings(Settings):
    tasks: Tasks  # the environments score the rollouts
    truncated_reward: float = read("reward.truncated_reward")
    overlong_reward: float = read("reward.overlong_reward")


def assign_rewards(
    turns: datasets.Dataset, environments: dict[str, Environment], settings: RewardSettings
) -> datasets.Dataset:
    """Score every finished rollout and put its final reward on each of its rows.

    Natural end: the environment's outcome reward of the final answer. Cut by the turn limit
    or the context budget: `settings.truncated_reward`. A turn that never ended (length):
    `settings.overlong_reward`. Failed (infrastructure): NaN, and the rollout stays flagged, so
    it is never mistaken for a scored 0. An environment whose reward raises fails its rollout
    the same way, with the exception's message, as one whose step raises does.
    """
    ordered = rollouts(turns)
    final_reward: dict[int, float] = {}
    reward_failures: dict[int, str] = {}  # rollout_id -> why its environment could not score it
    for rollout in ordered:
        end = turns[rollout.rows[-1]]  # the last turn says how the rollout ended
        if end["failed"]:
            final_reward[rollout.rollout_id] = math.nan
        elif end["stop_reason"] == StopReason.DONE:
            returned = (agent_state(end["env_state"]) or {}).get("end", {}).get("reward")
            try:  # an agent's own reward, or its task's reward of the final answer
                reward = (
                    returned
                    if returned is not None
                    else float(environments[end["task"]].reward(json.loads(end["task_payload"]), end))
                )
            except Exception as exc:  # an environment bug fails this rollout, visibly, not the run
                reward_failures[rollout.rollout_id] = f"environment '{end['task']}' reward raised {exc!r}"[:1000]
                reward = math.nan
            final_reward[rollout.rollout_id] = reward
        elif end["stop_reason"] == StopReason.LENGTH:
            final_reward[rollout.rollout_id] = settings.overlong_reward
        elif end["stop_reason"] is not None:
            final_reward[rollout.rollout_id] = settings.truncated_reward
    unfinished = [rollout.rollout_id for rollout in ordered if rollout.rollout_id not in final_reward]
    if unfinished:
        raise ValueError(f"rollouts {unfinished[:5]} have not finished: run all their turns first")
    turns = turns.select([row for rollout in ordered for row in rollout.rows])  # rollout by rollout, in turn order
    if reward_failures:
        turns = _flag_failed(turns, reward_failures)
    rewards = [final_reward[rollout.rollout_id] for rollout in ordered for _ in rollout.rows]
    return turns.add_column("reward", rewards, feature=ASSIGN_REWARDS["reward"])


def _flag_failed(turns: datasets.Dataset, failures: dict[int, str]) -> datasets.Dataset:
    """`failed` and `failure` set on every row of these rollouts; the columns keep their places."""
    ids = turns["rollout_id"]
    failed = [bool(f) or r in failures for f, r in zip(turns["failed"], ids)]
    failure = [failures.get(r, old) for old, r in zip(turns["failure"], ids)]
    columns = turns.column_names
    turns = turns.remove_columns(["failed", "failure"])
    turns = turns.add_column("failed", failed, feature=ASSIGN_REWARDS["failed"])
    turns = turns.add_column("failure", failure, feature=ASSIGN_REWARDS["failure"])
    return turns.select_columns(columns)


def rollout_metrics(
    turns: datasets.Dataset, environments: dict[str, Environment], max_turns: int | None
) -> dict[str, Any]:
    """Per-iteration rollout metrics (NeMo-RL's names where they exist), overall and per task.
    A rollout succeeded when its environment says its reward is a success (Environment.solved).

    Turns to solve, two ways: `mean_turns_to_solve` averages the solved rollouts only (it can
    rise while a policy gets better, by solving harder cases too); `mean_turns_to_solve_or_limit`
    counts an unsolved rollout as its task's turn limit (task.max_turns, `max_turns`, or its
    environment's own), a censored mean that falls only if rollouts solve more often or sooner.
    Failed rollouts count in neither."""
    columns = turns.select_columns(["task", "stop_reason", "failed", "reward"]).to_dict()
    everything: list[dict[str, Any]] = []  # one summary per rollout
    for rollout in rollouts(turns):
        end = rollout.rows[-1]  # the last turn says how the rollout ended
        task, failed, reward = columns["task"][end], columns["failed"][end], columns["reward"][end]
        everything.append(
            {
                "task": task,
                "turn": rollout.turns[-1],
                "stop": columns["stop_reason"][end],
                "failed": failed,
                "reward": reward,
                "solved": not failed and environments[task].solved(reward),
                "limit": environments[task].turn_limit(max_turns),
                "gen": sum(stop - start for start, stop in rollout.completion_spans),
                "env": sum(stop - start for start, stop in rollout.observation_spans),
            }
        )

    def summary(group: list[dict[str, Any]]) -> dict[str, Any]:
        n = max(1, len(group))
        scored = [r for r in group if not r["failed"]]
        solved_at = [r["turn"] + 1 for r in scored if r["stop"] == StopReason.DONE and r["solved"]]
        censored = [r["turn"] + 1 if r["stop"] == StopReason.DONE and r["solved"] else r["limit"] for r in scored]
        return {
            "rollouts": len(group),
            "reward_mean": float(np.mean([r["reward"] for r in scored])) if scored else None,
            "success_rate": float(np.mean([r["solved"] for r in scored])) if scored else None,
            "natural_termination_rate": sum(r["stop"] == StopReason.DONE for r in group) / n,
            "truncation_rate": sum(r["stop"] in (StopReason.CONTEXT_OVERFLOW, StopReason.LENGTH) for r in group) / n,
            "max_turns_reached_rate": sum(r["stop"] == StopReason.MAX_TURNS for r in group) / n,
            "failed_rate": sum(bool(r["failed"]) for r in group) / n,
            "mean_turns": float(np.mean([r["turn"] + 1 for r in group])) if group else 0.0,
            "max_turns": max((r["turn"] + 1 for r in group), default=0),
            "mean_turns_to_solve": float(np.mean(solved_at)) if solved_at else None,
            "mean_turns_to_solve_or_limit": float(np.mean(censored)) if censored else None,
            "mean_gen_tokens_per_rollout": sum(r["gen"] for r in group) / n,
            "mean_env_tokens_per_rollout": sum(r["env"] for r in group) / n,
        }

    tasks = sorted({r["task"] for r in everything})
    return {**summary(everything), "per_task": {t: summary([r for r in everything if r["task"] == t]) for t in tasks}}


def run(inputs: Inputs, settings: RewardSettings) -> Output:
    """assign-rewards on the last turn's execute-tools version (it names the earlier ones)."""
    turns = inputs.turns("execute-tools")
    environments = settings.tasks.environments()
    with PHASES.span("stage_compute"):  # the stage's own work, apart from reading and writing
        dataset = assign_rewards(turns, environments, settings)
    return Output(dataset, {"metrics": rollout_metrics(dataset, environments, settings.tasks.max_turns)})


STAGE = Stage(
    name="assign-rewards",
    inputs=("execute-tools",),  # the last turn's version; it names the earlier ones
    features=ASSIGN_REWARDS,
    settings=RewardSettings,
    run=run,
    rerun_from="execute-tools",
    distributed=True,
)
