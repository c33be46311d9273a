"""Estimators against groups computed by hand (not by calling the same code)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from schemas.config import AdvantageConfig
from schemas.features import ASSIGN_REWARDS, dataset_from_rows
from stages.compute_advantages import ESTIMATORS, compute_advantages, get_estimator, register

SQRT3 = math.sqrt(3.0)


def turns(rollouts: list[tuple[int, int, float, bool, list[int]]]):
    """Rows of an assign-rewards dataset: (rollout_id, group_id, reward, failed, tokens per turn)."""
    rows = []
    for rollout_id, group_id, reward, failed, lengths in rollouts:
        for turn, n in enumerate(lengths):
            rows.append(
                {
                    "rollout_id": rollout_id,
                    "group_id": group_id,
                    "turn": turn,
                    "reward": reward,
                    "failed": failed,
                    "completion_token_ids": list(range(n)),
                    "completion_logprobs": [-1.0] * n,
                    "tool_calls": [],
                    "context_token_ids": [],
                    "observation_token_ids": [],
                }
            )
    return dataset_from_rows(rows, ASSIGN_REWARDS)


def per_rollout(dataset) -> dict[int, float]:
    values = {}
    for rollout_id, advantages in zip(dataset["rollout_id"], dataset["advantages"]):
        assert len(set(advantages)) <= 1  # an outcome advantage is the same on every token
        if advantages:
            values[rollout_id] = advantages[0]
    return values


def test_grpo_normalises_by_the_unbiased_group_std():
    # group 0: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(1/3), advantages +-0.5*sqrt(3)
    # group 1: all equal -> 0
    data = turns(
        [
            (0, 0, 1.0, False, [3, 2]),
            (1, 0, 0.0, False, [4]),
            (2, 0, 0.0, False, [2]),
            (3, 0, 1.0, False, [1]),
            (4, 1, 1.0, False, [2]),
            (5, 1, 1.0, False, [2]),
        ]
    )
    out = compute_advantages(data, AdvantageConfig(estimator="grpo", epsilon=1e-6))
    expected = {0: 0.5 * SQRT3, 1: -0.5 * SQRT3, 2: -0.5 * SQRT3, 3: 0.5 * SQRT3, 4: 0.0, 5: 0.0}
    for rollout_id, value in per_rollout(out).items():
        assert value == pytest.approx(expected[rollout_id], rel=1e-5)
    # every completion token of every turn carries it; returns are the reward
    assert [len(a) for a in out["advantages"]] == [3, 2, 4, 2, 1, 2, 2]
    assert out["returns"][0] == [1.0, 1.0, 1.0]


def test_dr_grpo_does_not_divide_by_the_std():
    data = turns([(0, 0, 1.0, False, [1]), (1, 0, 0.0, False, [1]), (2, 0, 0.0, False, [1]), (3, 0, 0.0, False, [1])])
    out = per_rollout(compute_advantages(data, AdvantageConfig(estimator="grpo", normalize_by_std=False)))
    assert out == pytest.approx({0: 0.75, 1: -0.25, 2: -0.25, 3: -0.25})


def test_rloo_subtracts_the_mean_of_the_others():
    # r = 1,0,0,1: for a 1 the others average 1/3 -> +2/3; for a 0 they average 2/3 -> -2/3
    data = turns(
        [
            (0, 0, 1.0, False, [1]),
            (1, 0, 0.0, False, [1]),
            (2, 0, 0.0, False, [1]),
            (3, 0, 1.0, False, [1]),
            (4, 1, 3.0, False, [1]),
        ]
    )
    out = per_rollout(compute_advantages(data, AdvantageConfig(estimator="rloo")))
    assert out == pytest.approx({0: 2 / 3, 1: -2 / 3, 2: -2 / 3, 3: 2 / 3, 4: 3.0})  # a group of one: no baseline


def test_a_failed_rollout_does_not_move_its_groups_baseline():
    # The failed rollout (reward NaN) must not count as a 0: the baseline is mean(1,0,0) = 1/3,
    # std sqrt(1/3) -> advantages (2/3)*sqrt(3), (-1/3)*sqrt(3); the failed one gets 0.
    data = turns(
        [(0, 0, 1.0, False, [2]), (1, 0, 0.0, False, [2]), (2, 0, 0.0, False, [2]), (3, 0, float("nan"), True, [2, 3])]
    )
    out = per_rollout(compute_advantages(data, AdvantageConfig(estimator="grpo", epsilon=1e-9)))
    assert out == pytest.approx({0: 2 / 3 * SQRT3, 1: -1 / 3 * SQRT3, 2: -1 / 3 * SQRT3, 3: 0.0})
    rloo = per_rollout(compute_advantages(data, AdvantageConfig(estimator="rloo")))
    assert rloo == pytest.approx({0: 1.0, 1: -0.5, 2: -0.5, 3: 0.0})


def test_registry_names_valid_choices_and_refuses_duplicates():
    with pytest.raises(ValueError, match="valid: grpo, rloo"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(lambda r, g, c: np.zeros_like(r))
    assert set(ESTIMATORS) >= {"grpo", "rloo"}
