"""The PPO loss and logprobs against hand-computed cases, and one real update step."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.episodes import run_episodes
from schemas.config import PPOConfig, RunConfig
from schemas.features import COMPUTE_ADVANTAGES
from stages.generate_rollouts import Engine
from stages.ppo_update import (
    _collate,
    clipped_policy_loss,
    policy_logprobs,
    ppo_update,
    rollout_sequences,
    token_logprobs,
)


def test_clipped_loss_value_gradient_and_clip_fraction_by_hand():
    # ratios 1.1, 1.5, 0.5, 0.9 with advantages +1, +1, -1, -2, clip range [0.8, 1.28]:
    #   t1: unclipped -1.1 (> clipped -1.1? equal: no clip)  -> -1.1, d/dlogp = -A*ratio = -1.1
    #   t2: -1.5 vs clipped -1.28 -> -1.28 (clipped, no gradient)
    #   t3: 0.5 vs clipped 0.8    ->  0.8  (clipped, no gradient)
    #   t4: 1.8 vs clipped 1.8    ->  1.8, d/dlogp = -A*ratio = 1.8
    # token-mean: (-1.1 - 1.28 + 0.8 + 1.8) / 4 = 0.055; gradient /4; clipped 2 of 4
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    new = (old + torch.log(torch.tensor([1.1, 1.5, 0.5, 0.9]))).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -2.0])
    loss, stats = clipped_policy_loss(new, old, advantages, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(0.055, abs=1e-6)
    assert new.grad.tolist() == pytest.approx([-0.275, 0.0, 0.0, 0.45], abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    # approx KL (k3): mean((r - 1) - log r)
    expected_kl = sum((r - 1) - math.log(r) for r in (1.1, 1.5, 0.5, 0.9)) / 4
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)


def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (37,))
    temperature = 0.7
    chunked, entropy = token_logprobs(hidden, head, targets, temperature, chunk_tokens=8)
    chunked.sum().backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None
    full = torch.log_softmax(head(hidden) / temperature, -1)
    reference = full.gather(-1, targets[:, None])[:, 0]
    reference.sum().backward()
    assert torch.allclose(chunked, reference, atol=1e-6)
    assert torch.allclose(grad_chunked, hidden.grad, atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)


@pytest.fixture(scope="module")
def rollouts(tiny):
    model, tokenizer = tiny
    config = RunConfig(task={"rollouts": 8, "group_size": 8, "max_turns": 3}, generation={"max_new_tokens": 64})
    turns = run_episodes(Engine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]), tokenizer, config)
    # Fixed advantages: +1 for even rollouts, 0 for odd ones.
    advantages = [
        [1.0 if r % 2 == 0 else 0.0] * len(c) for r, c in zip(turns["rollout_id"], turns["completion_token_ids"])
    ]
    turns = turns.add_column("advantages", advantages, feature=COMPUTE_ADVANTAGES["advantages"])
    return turns.add_column("returns", advantages, feature=COMPUTE_ADVANTAGES["returns"])


def test_stored_old_logprobs_equal_the_training_forward_pass(tiny, rollouts):
    model, tokenizer = tiny
    batch = _collate(rollout_sequences(rollouts), tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logprobs, _ = policy_logprobs(model, batch, temperature=1.0, chunk_tokens=64)
    assert (logprobs - batch["old_logprobs"]).abs().max().item() < 1e-4


def test_one_ppo_step_lowers_the_loss_and_moves_logprobs_with_the_advantage(tiny, rollouts):
    model, tokenizer = tiny
    import copy

    trained = copy.deepcopy(model)
    sequences = rollout_sequences(rollouts)
    batch = _collate(sequences, tokenizer.pad_token_id, torch.device("cpu"))
    # A small step, so that the first-order picture holds: Adam's first step is along -sign(grad).
    config = PPOConfig(learning_rate=1e-4, minibatch_rollouts=len(sequences), epochs=1)

    def evaluate(m):
        with torch.no_grad():
            logprobs, _ = policy_logprobs(m, batch, 1.0, 64)
            loss, _ = clipped_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], 0.2, 0.28)
        return loss.item(), logprobs

    loss_before, before = evaluate(trained)
    metrics = ppo_update(trained, rollouts, config=config, temperature=1.0, pad_token_id=tokenizer.pad_token_id, seed=0)
    loss_after, after = evaluate(trained)
    positive = batch["advantages"] > 0
    assert len(metrics) == 1 and metrics[0]["grad_norm"] > 0
    assert loss_after < loss_before
    assert (after - before)[positive].mean() > 0
