"""compute-advantages: rewards -> per-token advantages and returns, behind one registry.

The time axis of a rollout is its *assistant tokens only*, concatenated over turns: tool and
observation tokens are not time steps (the agent did not choose them), so estimators step
over them. Rewards live on that axis:

    token_rewards[t] = per-turn reward at the last token of its turn
                     + the final reward at the last token of the rollout
                     - kl_coef * KL(t)          (only when the KL penalty is put in the reward)

An estimator is a small pure function registered by name:

    @register("name", needs_values=False)
    def name(batch: AdvantageInputs, settings: AdvantageSettings) -> (advantages, returns)

taking and returning one float array per rollout (aligned with its assistant tokens). Failed
rollouts (infrastructure failures, reward NaN) are removed before any estimator runs, so they
never move a baseline, and they get advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from runtime.passes import counting_passes
from runtime.phases import PHASES
from schemas.features import COMPUTE_ADVANTAGES
from schemas.stage import POLICY, Inputs, Output, Settings, Stage, read
from schemas.token_stream import rollouts
from stages.policy.loading import Device, ValueHead, exact_generation_logprobs, load_model, load_tokenizer
from stages.policy.scoring import kl_estimate, score_rollouts

REFERENCE = f"{POLICY}#reference"  # the input holding the KL's reference policy


class AdvantageSettings(Settings):
    estimator: str = read("advantage.estimator")
    normalize_by_std: bool = read("advantage.normalize_by_std")
    epsilon: float = read("advantage.epsilon")
    gamma: float = read("advantage.gamma")
    lam: float = read("advantage.lam")
    whiten_gae: bool = read("advantage.whiten_gae")
    # the KL penalty against the reference policy (in the reward, or its logprobs for the loss)
    kl_coef: float = read("ppo.kl_coef")
    kl_estimator: str = read("ppo.kl_estimator")
    kl_in: str = read("ppo.kl_in")
    # the scoring passes (critic values, reference logprobs): their layout sets the numbers to ~1e-6
    share_prefix: bool = read("ppo.share_prefix")
    micro_batch_rollouts: int = read("ppo.micro_batch_rollouts")
    logprob_chunk_tokens: int = read("ppo.logprob_chunk_tokens")
    temperature: float = read("generation.temperature")
    device: Device = read("model.device")
    # which logprobs generation stored: the hf engine in float32 stores the policy's own
    generation_engine: str = read("generation.engine")
    generation_dtype: str = read("model.dtype")


@dataclass
class AdvantageInputs:
    token_rewards: list[np.ndarray]  # per rollout, one float per assistant token
    group_ids: np.ndarray  # per rollout
    values: list[np.ndarray] | None = None  # per rollout, V(s_t) per assistant token (critic)

    @property
    def scores(self) -> np.ndarray:
        """Total reward of each rollout (outcome estimators use this scalar)."""
        return np.array([r.sum() for r in self.token_rewards], dtype=np.float64)


Estimator = Callable[[AdvantageInputs, AdvantageSettings], tuple[list[np.ndarray], list[np.ndarray]]]
ESTIMATORS: dict[str, Estimator] = {}
NEEDS_VALUES: set[str] = set()


def register(name: str, needs_values: bool = False) -> Callable[[Estimator], Estimator]:
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator '{name}' is already registered")
        ESTIMATORS[name] = fn
        if needs_values:
            NEEDS_VALUES.add(name)
        return fn

    return add


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator '{name}'; valid: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


# ---------------------------------------------------------------------------------------
# Helpers (pure numpy)
# ---------------------------------------------------------------------------------------


def group_stats(scores: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rollout: its group's size, sum of scores, and unbiased std (0 for groups of 1)."""
    _, index, size = np.unique(group_ids, return_inverse=True, return_counts=True)
    total = np.bincount(index, weights=scores)
    mean = total / size
    squares = np.bincount(index, weights=(scores - mean[index]) ** 2)
    std = np.sqrt(squares / np.maximum(size - 1, 1))
    return size[index].astype(np.float64), total[index], std[index]


def broadcast(per_rollout: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    return [np.full(len(tokens), value, dtype=np.float64) for value, tokens in zip(per_rollout, like)]


def whiten(arrays: list[np.ndarray], epsilon: float) -> list[np.ndarray]:
    """(x - mean) / std over every token of the batch (std unbiased, as verl's masked_whiten)."""
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    if flat.size < 2:
        return [a - flat.mean() if flat.size else a for a in arrays]
    mean, std = flat.mean(), flat.std(ddof=1)
    return [(a - mean) / (std + epsilon) for a in arrays]


def discounted_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """G_t = r_t + gamma * G_{t+1}, with G_T = 0."""
    returns, running = np.zeros_like(rewards, dtype=np.float64), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


# ---------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------


@register("grpo")
def grpo(batch: AdvantageInputs, settings: AdvantageSettings) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): (score - group mean) / (group std + eps).
    normalize_by_std=False leaves out the division by the std: Dr. GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783).
    A group of one has no baseline: its advantage is its score (as in verl)."""
    scores = batch.scores
    size, total, std = group_stats(scores, batch.group_ids)
    advantages = np.where(size > 1, scores - total / size, scores)
    if settings.normalize_by_std:
        advantages = np.where(size > 1, advantages / (std + settings.epsilon), advantages)
    per_token = broadcast(advantages, batch.token_rewards)
    return per_token, per_token


@register("rloo")
def rloo(batch: AdvantageInputs, settings: AdvantageSettings) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", arXiv:2402.14740): score minus the mean score of the *other* samples of the group."""
    scores = batch.scores
    size, total, _ = group_stats(scores, batch.group_ids)
    advantages = np.where(size > 1, scores - (total - scores) / np.maximum(size - 1, 1), scores)
    per_token = broadcast(advantages, batch.token_rewards)
    return per_token, per_token


@register("reinforce++")
def reinforce_plus_plus(
    batch: AdvantageInputs, settings: AdvantageSettings
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): discounted return of each token, whitened over the
    whole batch."""
    returns = [discounted_returns(r, settings.gamma) for r in batch.token_rewards]
    return whiten(returns, settings.epsilon), returns


@register("reinforce++-baseline")
def reinforce_plus_plus_baseline(
    batch: AdvantageInputs, settings: AdvantageSettings
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """REINFORCE++-baseline (Hu et al. 2025, REINFORCE++, arXiv:2501.03262): the score minus its group's mean,
    then whitened over the whole batch."""
    scores = batch.scores
    size, total, _ = group_stats(scores, batch.group_ids)
    centred = np.where(size > 1, scores - total / size, scores)
    advantages = whiten(broadcast(centred, batch.token_rewards), settings.epsilon)
    return advantages, advantages


@register("gae", needs_values=True)
def gae(batch: AdvantageInputs, settings: AdvantageSettings) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Generalised advantage estimation (Schulman et al. 2015, GAE, arXiv:1506.02438) over assistant tokens
    with the critic's values:
    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0),
    A_t = delta_t + gamma lam A_{t+1}, returns_t = A_t + V_t."""
    assert batch.values is not None, "gae needs the critic's values"
    advantages, returns = [], []
    for rewards, values in zip(batch.token_rewards, batch.values):
        adv = np.zeros(len(rewards), dtype=np.float64)
        running, next_value = 0.0, 0.0
        for t in range(len(rewards) - 1, -1, -1):
            delta = rewards[t] + settings.gamma * next_value - values[t]
            running = delta + settings.gamma * settings.lam * running
            adv[t], next_value = running, values[t]
        advantages.append(adv)
        returns.append(adv + values)
    if settings.whiten_gae:
        advantages = whiten(advantages, settings.epsilon)
    return advantages, returns


# ---------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------


def compute_advantages(
    turns: datasets.Dataset,
    settings: AdvantageSettings,
    *,
    values: list[list[float]] | None = None,
    kl_penalty: list[list[float]] | None = None,
    ref_logprobs: list[list[float]] | None = None,
) -> datasets.Dataset:
    """Add advantages, returns, values and ref_logprobs (one float32 per completion token).

    `values` (critic values) and `kl_penalty` (kl_coef * KL per token, subtracted from the
    rewards) are row-aligned with `turns`; score_with_policies computes them with the policy
    and the reference model before this pure function runs.
    """
    estimator = get_estimator(settings.estimator)
    columns = turns.select_columns(["group_id", "reward", "turn_reward", "failed", "completion_token_ids"]).to_dict()
    lengths = [len(tokens) for tokens in columns["completion_token_ids"]]
    by_rollout = {rollout.rollout_id: rollout.rows for rollout in rollouts(turns)}  # rows in turn order

    def failed(rows: list[int]) -> bool:
        return any(columns["failed"][r] for r in rows) or not np.isfinite(columns["reward"][rows[-1]])

    valid = [rid for rid, rows in by_rollout.items() if not failed(rows)]
    token_rewards, rollout_values = [], []
    for rollout_id in valid:
        rows = by_rollout[rollout_id]
        pieces = []
        for position, row in enumerate(rows):
            rewards = np.zeros(lengths[row], dtype=np.float64)
            if lengths[row]:
                rewards[-1] += columns["turn_reward"][row]
                if position == len(rows) - 1:
                    rewards[-1] += columns["reward"][row]
            if kl_penalty is not None:
                rewards -= np.asarray(kl_penalty[row], dtype=np.float64)
            pieces.append(rewards)
        token_rewards.append(np.concatenate(pieces))
        if values is not None:
            rollout_values.append(np.concatenate([np.asarray(values[row], dtype=np.float64) for row in rows]))
    batch = AdvantageInputs(
        token_rewards=token_rewards,
        group_ids=np.array([columns["group_id"][by_rollout[r][0]] for r in valid]),
        values=rollout_values if values is not None else None,
    )
    advantages, returns = estimator(batch, settings) if valid else ([], [])

    # Split each rollout's arrays back into its turns.
    row_advantages: list[list[float]] = [[0.0] * n for n in lengths]
    row_returns: list[list[float]] = [[0.0] * n for n in lengths]
    for rollout_id, adv, ret in zip(valid, advantages, returns):
        start = 0
        for row in by_rollout[rollout_id]:
            row_advantages[row] = adv[start : start + lengths[row]].tolist()
            row_returns[row] = ret[start : start + lengths[row]].tolist()
            start += lengths[row]
    for name, column in (
        ("advantages", row_advantages),
        ("returns", row_returns),
        ("values", values if values is not None else [[] for _ in lengths]),
        ("ref_logprobs", ref_logprobs if ref_logprobs is not None else [[] for _ in lengths]),
    ):
        turns = turns.add_column(name, column, feature=COMPUTE_ADVANTAGES[name])
    return turns


# ---------------------------------------------------------------------------------------
# Scoring with the critic and the reference policy (before the estimator runs)
# ---------------------------------------------------------------------------------------


def kl_penalty(
    generation_logprobs: list[list[float]], ref_logprobs: list[list[float]], kl_coef: float, estimator: str
) -> list[list[float]]:
    """kl_coef * KL(policy || reference) per completion token (ppo.kl_in = "reward"): subtracted
    from the token rewards, so the estimator sees a reward that pays for drifting away."""
    return [
        (kl_coef * kl_estimate(torch.tensor(generated), torch.tensor(reference), estimator)).tolist()
        for generated, reference in zip(generation_logprobs, ref_logprobs)
    ]


def score_with_policies(
    turns: datasets.Dataset,
    settings: AdvantageSettings,
    *,
    critic_dir: str | Path | None,
    reference_dir: str | Path | None,
    reference_generated: bool = False,
) -> dict[str, Any]:
    """The keyword inputs of compute_advantages: the critic's values (from the value head saved
    beside the generating policy, `critic_dir`) and the reference policy's logprobs, with the KL
    penalty when it goes into the reward. None where the settings do not use them.
    `reference_generated`: the reference policy generated these rollouts and their stored
    logprobs are exact (the first iteration, exact_generation_logprobs): they are its logprobs,
    and its forward pass is skipped."""

    def score(policy_dir: str | Path, with_value_head: bool) -> tuple[list[list[float]], list[list[float]]]:
        """The values (with the value head) or the reference logprobs."""
        model = load_model(policy_dir, "float32", settings.device)
        return score_rollouts(
            model,
            turns,
            temperature=settings.temperature,
            pad_token_id=load_tokenizer(str(policy_dir)).pad_token_id,
            chunk_tokens=settings.logprob_chunk_tokens,
            batch_rollouts=settings.micro_batch_rollouts,
            value_head=ValueHead.load(policy_dir, model.config.hidden_size) if with_value_head else None,
            share_prefix=settings.share_prefix,
            kind="values" if with_value_head else "reference",
        )

    values = score(critic_dir, with_value_head=True)[1] if critic_dir is not None else None
    ref_logprobs = None
    if reference_generated:  # plain lists: a datasets Column would give the new column a random fingerprint
        ref_logprobs = [list(logprobs) for logprobs in turns["completion_logprobs"]]
    elif reference_dir is not None:
        ref_logprobs = score(reference_dir, with_value_head=False)[0]
    penalty = None
    if ref_logprobs is not None and settings.kl_in == "reward":
        penalty = kl_penalty(turns["completion_logprobs"], ref_logprobs, settings.kl_coef, settings.kl_estimator)
    return {"values": values, "ref_logprobs": ref_logprobs, "kl_penalty": penalty}


def advantage_metrics(turns: datasets.Dataset) -> dict[str, float]:
    """Mean and mean absolute advantage over all completion tokens (for the manifest)."""
    per_token = np.concatenate([np.asarray(a, dtype=np.float32) for a in turns["advantages"]] or [np.zeros(0)])
    return {
        "advantage_mean": float(per_token.mean()) if per_token.size else 0.0,
        "advantage_abs_mean": float(np.abs(per_token).mean()) if per_token.size else 0.0,
    }


def needed_inputs(settings: AdvantageSettings) -> tuple[str, ...]:
    """The rewarded rollouts; the generating policy's critic for an estimator that needs values;
    the reference policy for a KL penalty."""
    critic = (POLICY,) if settings.estimator in NEEDS_VALUES else ()
    reference = (REFERENCE,) if settings.kl_coef > 0 else ()
    return ("assign-rewards", *critic, *reference)


def run(inputs: Inputs, settings: AdvantageSettings) -> Output:
    """compute-advantages on an assign-rewards version (with the critic and reference inputs its
    settings need)."""
    turns = inputs.load("assign-rewards")
    reference = inputs.parents.get(REFERENCE)
    # The first iteration's rollouts come from the reference policy itself: with exact generation
    # logprobs those are its logprobs, and no pass is needed.
    reference_generated = reference == inputs.generating_policy("assign-rewards").version and (
        exact_generation_logprobs(settings.generation_engine, settings.generation_dtype)
    )
    with counting_passes() as passes, PHASES.span("stage_compute"):
        scored = score_with_policies(
            turns,
            settings,
            critic_dir=inputs.folder(POLICY) if POLICY in inputs.parents else None,
            reference_dir=inputs.folder(REFERENCE) if reference else None,
            reference_generated=reference_generated,
        )
        dataset = compute_advantages(turns, settings, **scored)
    # passes: the reference and value passes; one is absent where no setting needs it (no KL term,
    # no critic, the first iteration's exact generation logprobs)
    return Output(
        dataset,
        {
            "metrics": advantage_metrics(dataset),
            "reference_logprobs": None if reference is None else "generation" if reference_generated else "scored",
            "passes": passes,
        },
    )


STAGE = Stage(
    name="compute-advantages",
    inputs=needed_inputs,
    features=COMPUTE_ADVANTAGES,
    settings=AdvantageSettings,
    run=run,
    rerun_from="assign-rewards",
)
