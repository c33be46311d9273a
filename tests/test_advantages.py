"""Estimators against cases computed by hand in the test (not by calling the same code)."""

from __future__ import annotations

import math

import pytest

from schemas.config import RunConfig
from schemas.features import ASSIGN_REWARDS, dataset_from_rows
from stages.compute_advantages import (
    ESTIMATORS,
    NEEDS_VALUES,
    AdvantageSettings,
    compute_advantages,
    get_estimator,
    register,
)

SQRT3 = math.sqrt(3.0)


def advantage_settings(**advantage) -> AdvantageSettings:
    """compute-advantages' settings of a run config with these advantage.* fields (the rest default)."""
    return AdvantageSettings.resolve(RunConfig(advantage=advantage))


def turns(rollouts):
    """An assign-rewards dataset from (rollout_id, group_id, final reward, failed, turns), where
    turns is a list of (completion tokens, turn reward) and every turn but the last is
    followed by 3 observation tokens (which are not time steps)."""
    rows = []
    for rollout_id, group_id, reward, failed, turn_specs in rollouts:
        for turn, (n, turn_reward) in enumerate(turn_specs):
            rows.append(
                {
                    "rollout_id": rollout_id,
                    "group_id": group_id,
                    "turn": turn,
                    "reward": reward,
                    "turn_reward": turn_reward,
                    "failed": failed,
                    "completion_token_ids": list(range(n)),
                    "completion_logprobs": [-1.0] * n,
                    "tool_calls": [],
                    "context_token_ids": [7],
                    "observation_token_ids": [9, 9, 9] if turn < len(turn_specs) - 1 else [],
                }
            )
    return dataset_from_rows(rows, ASSIGN_REWARDS)


def outcome(rollout_id, group_id, reward, failed=False, lengths=(1,)):
    return rollout_id, group_id, reward, failed, [(n, 0.0) for n in lengths]


def per_rollout(dataset) -> dict[int, float]:
    values = {}
    for rollout_id, advantages in zip(dataset["rollout_id"], dataset["advantages"]):
        assert len(set(advantages)) <= 1  # an outcome advantage is the same on every token
        if advantages:
            values[rollout_id] = advantages[0]
    return values


def tokens_of(dataset, column: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for rollout_id, _turn, values in sorted(zip(dataset["rollout_id"], dataset["turn"], dataset[column])):
        out.setdefault(rollout_id, []).extend(values)
    return out


def test_grpo_normalises_by_the_unbiased_group_std():
    # group 0: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(1/3): advantages +-0.5*sqrt(3)
    # group 1: all equal -> 0
    data = turns(
        [
            outcome(0, 0, 1.0, lengths=(3, 2)),
            outcome(1, 0, 0.0, lengths=(4,)),
            outcome(2, 0, 0.0),
            outcome(3, 0, 1.0),
            outcome(4, 1, 1.0),
            outcome(5, 1, 1.0),
        ]
    )
    out = compute_advantages(data, advantage_settings(estimator="grpo", epsilon=1e-6))
    expected = {0: 0.5 * SQRT3, 1: -0.5 * SQRT3, 2: -0.5 * SQRT3, 3: 0.5 * SQRT3, 4: 0.0, 5: 0.0}
    assert per_rollout(out) == pytest.approx(expected, rel=1e-5)
    assert [len(a) for a in out["advantages"]] == [3, 2, 4, 1, 1, 1, 1]  # every completion token
    assert out["values"][0] == [] and out["ref_logprobs"][0] == []


def test_dr_grpo_does_not_divide_by_the_std():
    data = turns([outcome(0, 0, 1.0), outcome(1, 0, 0.0), outcome(2, 0, 0.0), outcome(3, 0, 0.0)])
    out = per_rollout(compute_advantages(data, advantage_settings(estimator="grpo", normalize_by_std=False)))
    assert out == pytest.approx({0: 0.75, 1: -0.25, 2: -0.25, 3: -0.25})


def test_rloo_subtracts_the_mean_of_the_others():
    # r = 1,0,0,1: for a 1 the others average 1/3 -> +2/3; for a 0 they average 2/3 -> -2/3
    data = turns([outcome(0, 0, 1.0), outcome(1, 0, 0.0), outcome(2, 0, 0.0), outcome(3, 0, 1.0), outcome(4, 1, 3.0)])
    out = per_rollout(compute_advantages(data, advantage_settings(estimator="rloo")))
    assert out == pytest.approx({0: 2 / 3, 1: -2 / 3, 2: -2 / 3, 3: 2 / 3, 4: 3.0})  # a group of one: no baseline


def test_a_failed_rollout_does_not_move_its_groups_baseline():
    # The failed rollout (reward NaN) must not count as a 0: the baseline is mean(1,0,0) = 1/3,
    # std sqrt(1/3) -> advantages (2/3)*sqrt(3), (-1/3)*sqrt(3); the failed one gets 0.
    data = turns(
        [
            outcome(0, 0, 1.0, lengths=(2,)),
            outcome(1, 0, 0.0, lengths=(2,)),
            outcome(2, 0, 0.0, lengths=(2,)),
            outcome(3, 0, float("nan"), failed=True, lengths=(2, 3)),
        ]
    )
    out = per_rollout(compute_advantages(data, advantage_settings(estimator="grpo", epsilon=1e-9)))
    assert out == pytest.approx({0: 2 / 3 * SQRT3, 1: -1 / 3 * SQRT3, 2: -1 / 3 * SQRT3, 3: 0.0})
    rloo = per_rollout(compute_advantages(data, advantage_settings(estimator="rloo")))
    assert rloo == pytest.approx({0: 1.0, 1: -0.5, 2: -0.5, 3: 0.0})


def test_reinforce_plus_plus_discounts_then_whitens_over_the_batch():
    # gamma 0.5: rollout 0 (2 tokens, reward 1): returns [0.5, 1]; rollout 1 (3 tokens, 0): [0, 0, 0]
    # all 5 tokens: mean 0.3, unbiased var 0.8/4 = 0.2 -> advantages (x - 0.3) / sqrt(0.2)
    data = turns([outcome(0, 0, 1.0, lengths=(2,)), outcome(1, 1, 0.0, lengths=(3,))])
    out = compute_advantages(data, advantage_settings(estimator="reinforce++", gamma=0.5, epsilon=1e-12))
    s = math.sqrt(0.2)
    assert tokens_of(out, "returns") == {0: pytest.approx([0.5, 1.0]), 1: pytest.approx([0, 0, 0])}
    assert tokens_of(out, "advantages") == {
        0: pytest.approx([0.2 / s, 0.7 / s], rel=1e-5),
        1: pytest.approx([-0.3 / s] * 3, rel=1e-5),
    }


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    # group scores 1, 0 -> centred 0.5, -0.5 on 1 and 2 tokens: [0.5, -0.5, -0.5]
    # mean -1/6, unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3 -> [2/3, -1/3, -1/3] * sqrt(3)
    data = turns([outcome(0, 0, 1.0, lengths=(1,)), outcome(1, 0, 0.0, lengths=(2,))])
    out = compute_advantages(data, advantage_settings(estimator="reinforce++-baseline", epsilon=1e-12))
    assert tokens_of(out, "advantages") == {
        0: pytest.approx([2 / 3 * SQRT3], rel=1e-5),
        1: pytest.approx([-1 / 3 * SQRT3] * 2, rel=1e-5),
    }


def test_gae_steps_over_observation_tokens_with_per_turn_rewards():
    # One rollout: turn 0 samples 2 tokens (turn reward 0.5 on its last token), then 3
    # observation tokens that are NOT time steps, then turn 1 samples 1 token (final reward 1).
    # Time axis t0, t1, t2: rewards [0, 0.5, 1], values [0.2, 0.4, 0.6], gamma 0.9, lam 0.8:
    #   t2: delta = 1 + 0 - 0.6 = 0.4                      A = 0.4
    #   t1: delta = 0.5 + 0.9*0.6 - 0.4 = 0.64             A = 0.64 + 0.72*0.4 = 0.928
    #   t0: delta = 0 + 0.9*0.4 - 0.2 = 0.16               A = 0.16 + 0.72*0.928 = 0.82816
    #   returns = A + V = [1.02816, 1.328, 1.0]
    data = turns([(0, 0, 1.0, False, [(2, 0.5), (1, 0.0)])])
    config = advantage_settings(estimator="gae", gamma=0.9, lam=0.8, whiten_gae=False)
    out = compute_advantages(data, config, values=[[0.2, 0.4], [0.6]])
    assert tokens_of(out, "advantages")[0] == pytest.approx([0.82816, 0.928, 0.4], rel=1e-5)
    assert tokens_of(out, "returns")[0] == pytest.approx([1.02816, 1.328, 1.0], rel=1e-5)
    assert tokens_of(out, "values")[0] == pytest.approx([0.2, 0.4, 0.6])
    assert "gae" in NEEDS_VALUES


def test_kl_penalty_in_the_reward_is_subtracted_per_token():
    # reward 1 on 2 tokens with penalties [0.1, 0.2]: token rewards [-0.1, 0.8], returns (gamma 1) [0.7, 0.8]
    data = turns([outcome(0, 0, 1.0, lengths=(2,)), outcome(1, 1, 0.0, lengths=(1,))])
    out = compute_advantages(
        data, advantage_settings(estimator="reinforce++"), kl_penalty=[[0.1, 0.2], [0.0]], ref_logprobs=[[-1, -2], [-3]]
    )
    assert tokens_of(out, "returns") == {0: pytest.approx([0.7, 0.8]), 1: pytest.approx([0.0])}
    assert out["ref_logprobs"][0] == [-1.0, -2.0]


def test_registry_names_valid_choices_and_refuses_duplicates():
    with pytest.raises(ValueError, match="valid: gae, grpo, reinforce\\+\\+, reinforce\\+\\+-baseline, rloo"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(lambda batch, config: ([], []))
    assert set(ESTIMATORS) == {"grpo", "rloo", "reinforce++", "reinforce++-baseline", "gae"}


def test_the_first_iterations_reference_logprobs_are_its_exact_generation_logprobs(tiny):
    """Iteration 0's rollouts come from the reference policy itself: with exact generation
    logprobs (hf engine, float32) compute-advantages takes them instead of a reference forward
    pass; they agree within 1e-5, and so do the advantages with the KL penalty in the reward."""
    from pipeline.models.base_model import EMBEDDED_POLICY
    from pipeline.orchestration.episodes import run_episodes
    from stages.compute_advantages import score_with_policies
    from stages.generate_rollouts.hf import HFEngine
    from stages.policy.loading import eos_token_ids, exact_generation_logprobs

    model, tokenizer = tiny
    config = RunConfig(
        task={"rollouts": 8, "group_size": 4, "max_turns": 2},
        generation={"max_new_tokens": 48},
        reward={"overlong_reward": -0.5},  # rewards that differ: advantages not made of the KL term's rounding alone
        model={"device": "cpu"},
        ppo={"kl_in": "reward", "kl_coef": 0.05},
    )
    assert exact_generation_logprobs(config.generation.engine, config.model.dtype)
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    rewarded = run_episodes(engine, tokenizer, config)
    settings = AdvantageSettings.resolve(config)
    common = {"critic_dir": None, "reference_dir": EMBEDDED_POLICY}
    scored = score_with_policies(rewarded, settings, **common)
    reused = score_with_policies(rewarded, settings, **common, reference_generated=True)
    for fresh, stored in zip(scored["ref_logprobs"], reused["ref_logprobs"]):
        assert len(fresh) == len(stored) and max((abs(a - b) for a, b in zip(fresh, stored)), default=0) < 1e-5
    by_forward = compute_advantages(rewarded, settings, **scored)
    by_reuse = compute_advantages(rewarded, settings, **reused)
    for fresh, stored in zip(by_forward["advantages"], by_reuse["advantages"]):
        assert max((abs(a - b) for a, b in zip(fresh, stored)), default=0) < 1e-5
    assert sum(len(a) for a in by_reuse["advantages"]) > 0
