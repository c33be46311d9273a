"""compute-advantages: turn final rewards into per-token advantages, behind one registry.

An outcome estimator is a small pure function

    estimator(rewards, group_ids, config) -> advantages     (one float per rollout)

registered by name with @register. Failed rollouts (infrastructure failures, reward NaN)
are removed *before* the estimator runs, so they never move their group's baseline, and
they get advantage 0 on every token. The rollout's advantage is placed on every token it
sampled, in every turn; observation tokens are not trained and carry nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import datasets
import numpy as np

from schemas.config import AdvantageConfig
from schemas.features import COMPUTE_ADVANTAGES

Estimator = Callable[[np.ndarray, np.ndarray, AdvantageConfig], np.ndarray]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator '{name}' is already registered")
        ESTIMATORS[name] = fn
        return fn

    return add


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator '{name}'; valid: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


def _group_stats(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rollout: its group's size, sum of rewards, and unbiased std (0 for groups of 1)."""
    groups, index, size = np.unique(group_ids, return_inverse=True, return_counts=True)
    total = np.bincount(index, weights=rewards, minlength=len(groups))
    mean = total / size
    squares = np.bincount(index, weights=(rewards - mean[index]) ** 2, minlength=len(groups))
    std = np.sqrt(squares / np.maximum(size - 1, 1))
    return size[index].astype(np.float64), total[index], std[index]


@register("grpo")
def grpo(rewards: np.ndarray, group_ids: np.ndarray, config: AdvantageConfig) -> np.ndarray:
    """GRPO: (r - group mean) / (group std + eps); without the std division it is Dr. GRPO.
    A group of one has no baseline: its advantage is its reward (as in verl)."""
    size, total, std = _group_stats(rewards, group_ids)
    advantages = np.where(size > 1, rewards - total / size, rewards)
    if config.normalize_by_std:
        advantages = np.where(size > 1, advantages / (std + config.epsilon), advantages)
    return advantages


@register("rloo")
def rloo(rewards: np.ndarray, group_ids: np.ndarray, config: AdvantageConfig) -> np.ndarray:
    """RLOO: r minus the mean reward of the *other* samples of the group."""
    size, total, _ = _group_stats(rewards, group_ids)
    leave_one_out_mean = (total - rewards) / np.maximum(size - 1, 1)
    return np.where(size > 1, rewards - leave_one_out_mean, rewards)


def compute_advantages(turns: datasets.Dataset, config: AdvantageConfig) -> datasets.Dataset:
    """Add `advantages` and `returns` (one float32 per completion token) to every turn."""
    estimator = get_estimator(config.estimator)
    columns = turns.select_columns(["rollout_id", "group_id", "reward", "failed"]).to_dict()
    rollouts: dict[int, tuple[int, float, bool]] = {}
    for rollout_id, group_id, reward, failed in zip(*columns.values()):
        previous = rollouts.get(rollout_id, (group_id, reward, False))
        rollouts[rollout_id] = (group_id, reward, previous[2] or bool(failed) or not np.isfinite(reward))
    ids = np.array(sorted(rollouts))
    group_ids = np.array([rollouts[r][0] for r in ids])
    rewards = np.array([rollouts[r][1] for r in ids], dtype=np.float64)
    valid = ~np.array([rollouts[r][2] for r in ids])
    per_rollout = np.zeros(len(ids), dtype=np.float64)
    if valid.any():
        per_rollout[valid] = estimator(rewards[valid], group_ids[valid], config)
    advantage_of = dict(zip(ids.tolist(), per_rollout.tolist()))
    return_of = dict(zip(ids.tolist(), np.where(valid, rewards, 0.0).tolist()))

    lengths = [len(tokens) for tokens in turns["completion_token_ids"]]
    advantages = [[advantage_of[r]] * n for r, n in zip(columns["rollout_id"], lengths)]
    returns = [[return_of[r]] * n for r, n in zip(columns["rollout_id"], lengths)]
    turns = turns.add_column("advantages", advantages, feature=COMPUTE_ADVANTAGES["advantages"])
    return turns.add_column("returns", returns, feature=COMPUTE_ADVANTAGES["returns"])
