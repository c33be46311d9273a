"""PPO losses against hand-computed cases, and real update steps on the embedded model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pipeline.orchestration.episodes import run_episodes
from runtime.passes import counting_passes
from schemas.config import RunConfig
from schemas.features import COMPUTE_ADVANTAGES
from stages.generate_rollouts.hf import HFEngine
from stages.policy.batching import (
    RolloutSequence,
    collate,
    common_prefix_length,
    computed_tokens,
    micro_batches,
    prefix_units,
    rollout_sequences,
    shares_prefix,
)
from stages.policy.loading import ValueHead, eos_token_ids
from stages.policy.scoring import forward_targets, kl_estimate, score_rollouts, token_logprobs
from stages.ppo_update import (
    PPOSettings,
    aggregate,
    build_optimizer,
    old_logprobs_recomputed,
    optimise_policy,
    policy_loss,
    token_loss,
    value_loss,
)
from stages.ppo_update.checkpoint import load_optimizer_state, save_optimizer_state


def ppo_settings(**ppo) -> PPOSettings:
    """ppo-update's settings of a run config with these ppo.* fields (the rest default)."""
    return PPOSettings.resolve(RunConfig(ppo=ppo))


def test_clipped_loss_value_and_gradient_by_hand():
    # ratios 1.1, 1.5, 0.5, 0.9 with advantages +1, +1, -1, -2, clip range [0.8, 1.28]:
    #   t1: -1.1 (inside the range)               d/dlogp = -A*ratio = -1.1
    #   t2: max(-1.5, -1.28) = -1.28 (clipped)     no gradient
    #   t3: max(0.5, 0.8) = 0.8 (clipped)          no gradient
    #   t4: max(1.8, 1.8) = 1.8                    d/dlogp = 1.8
    # token mean (-1.1 - 1.28 + 0.8 + 1.8) / 4 = 0.055; gradient / 4; 2 of 4 clipped
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    new = (old + torch.log(torch.tensor([1.1, 1.5, 0.5, 0.9]))).requires_grad_()
    per_token, clipped = policy_loss(new, old, torch.tensor([1.0, 1.0, -1.0, -2.0]), 0.2, 0.28, clip_ratio_c=None)
    loss = per_token.mean()
    loss.backward()
    assert loss.item() == pytest.approx(0.055, abs=1e-6)
    assert new.grad.tolist() == pytest.approx([-0.275, 0.0, 0.0, 0.45], abs=1e-6)
    assert clipped.tolist() == [False, True, True, False]


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # A = -1: ratio 5 -> max(5, 1.28) = 5 > c = 3 -> 3 (constant, no gradient);
    #         ratio 2 -> max(2, 1.28) = 2 < 3 -> 2, d/dlogp = -A*ratio = 2
    old = torch.zeros(2)
    new = torch.log(torch.tensor([5.0, 2.0])).requires_grad_()
    per_token, clipped = policy_loss(new, old, torch.tensor([-1.0, -1.0]), 0.2, 0.28, clip_ratio_c=3.0)
    per_token.sum().backward()
    assert per_token.tolist() == pytest.approx([3.0, 2.0])
    assert new.grad.tolist() == pytest.approx([0.0, 2.0])
    assert clipped.tolist() == [True, False]


def test_kl_estimators_by_hand():
    # log(pi / pi_ref) = 1: k1 = 1, k2 = 1/2, k3 = e^-1 - 1 + 1 = e^-1
    logprobs, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_estimate(logprobs, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logprobs, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(logprobs, ref, "k3").item() == pytest.approx(math.exp(-1))
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_estimate(logprobs, ref, "k4")


def test_value_loss_clipped_by_hand():
    # V = 1.5, V_old = 1.0, R = 2.0, clip 0.2: (1.5 - 2)^2 = 0.25; clipped V 1.2 -> 0.64; 0.5 * max = 0.32
    values, old, returns = torch.tensor([1.5]), torch.tensor([1.0]), torch.tensor([2.0])
    assert value_loss(values, old, returns, clip=0.2).item() == pytest.approx(0.32)
    assert value_loss(values, old, returns, clip=None).item() == pytest.approx(0.125)


def test_tis_entropy_kl_and_value_terms_of_the_token_loss_by_hand():
    # Two tokens, ratio pi/pi_old = 1, so the surrogate is -A: [-1, 2] for A = [1, -2].
    #   TIS: pi_old/pi_gen = 3 -> capped at 2; 0.5 -> 0.5         weighted surrogate [-2, 1]
    #   entropy bonus 0.1 * H, H = [0.5, 1.5]                       [-0.05, -0.15]
    #   KL k3 in the loss, 0.2 * k3: log(pi/pi_ref) = [1, 0]        [0.2/e, 0]
    #   value loss 0.5 * 0.32 (V 1.5, V_old 1, R 2, clip 0.2)       [0.16, 0]
    #   total = [-2 - 0.05 + 0.2/e + 0.16, 1 - 0.15] = [-1.89 + 0.2/e, 0.85]
    # d total / d logprob = -A * ratio * w + 0.2 * (1 - e^-(log r)) = [-2 + 0.2(1 - 1/e), 1]:
    # the IS weight is a constant (old and generation logprobs), never differentiated.
    generation = torch.tensor([-1.0, -2.0])
    old = generation + torch.log(torch.tensor([3.0, 0.5]))
    logprobs = old.clone().requires_grad_()
    batch = {
        "old_logprobs": old,
        "generation_logprobs": generation,
        "advantages": torch.tensor([1.0, -2.0]),
        "ref_logprobs": old - torch.tensor([1.0, 0.0]),
        "old_values": torch.tensor([1.0, 0.0]),
        "returns": torch.tensor([2.0, 0.0]),
    }
    config = ppo_settings(
        tis_cap=2.0, entropy_coef=0.1, kl_coef=0.2, kl_estimator="k3", kl_in="loss", value_coef=0.5, value_clip=0.2
    )
    values = torch.tensor([1.5, 0.0])
    total, terms, clipped, is_weight = token_loss(batch, logprobs, torch.tensor([0.5, 1.5]), values, config)
    total.sum().backward()
    e = math.e
    assert is_weight.tolist() == pytest.approx([2.0, 0.5])
    assert terms["policy_loss"].tolist() == pytest.approx([-2.0, 1.0])
    assert terms["kl"].tolist() == pytest.approx([1 / e, 0.0], abs=1e-6)
    assert terms["value_loss"].tolist() == pytest.approx([0.32, 0.0])
    assert total.tolist() == pytest.approx([-1.89 + 0.2 / e, 0.85], abs=1e-6)
    assert logprobs.grad.tolist() == pytest.approx([-2.0 + 0.2 * (1 - 1 / e), 1.0], abs=1e-6)
    assert clipped.tolist() == [False, False]
    # KL in the reward (or kl_coef 0) leaves the loss; no critic values, no value loss.
    total, terms, _, _ = token_loss(
        batch, old, torch.tensor([0.5, 1.5]), None, config.model_copy(update={"kl_in": "reward"})
    )
    assert set(terms) == {"policy_loss", "entropy"}
    assert total.tolist() == pytest.approx([-2.05, 0.85])


def test_the_decoupled_loss_of_stale_rollouts_by_hand():
    # Rollouts of a behaviour policy mu (ppo.max_staleness), the update starting from pi_old (the
    # proximal policy, its logprobs recomputed), now at pi. Per token (AReaL's decoupled PPO with a
    # truncated weight): -min(pi_old/mu, cap) * min(r A, clip(r) A), r = pi / pi_old, clip [0.8, 1.28].
    #   pi_old/mu = 1.5, 4, 0.5 -> w = 1.5, 2 (capped), 0.5;  r = 1.1, 1.5, 0.7;  A = 1, 1, -1
    #   t1: -1.5 * 1.1 = -1.65, gradient -A * r * w = -1.65
    #   t2: -2 * 1.28 = -2.56 (clipped: no gradient)
    #   t3: A < 0: max(0.7, 0.8) = 0.8 (clipped), 0.5 * 0.8 = 0.4, no gradient
    # The clip is around pi_old, not mu: PPO against mu alone would see r = 1.65 at t1 and clip it.
    behaviour = torch.tensor([-1.0, -1.0, -2.0])
    old = behaviour + torch.log(torch.tensor([1.5, 4.0, 0.5]))
    logprobs = (old + torch.log(torch.tensor([1.1, 1.5, 0.7]))).requires_grad_()
    batch = {"old_logprobs": old, "generation_logprobs": behaviour, "advantages": torch.tensor([1.0, 1.0, -1.0])}
    config = ppo_settings(tis_cap=2.0, clip_low=0.2, clip_high=0.28, clip_ratio_c=None, entropy_coef=0.0, kl_coef=0.0)
    total, _, clipped, is_weight = token_loss(batch, logprobs, torch.zeros(3), None, config)
    total.sum().backward()
    assert is_weight.tolist() == pytest.approx([1.5, 2.0, 0.5])
    assert total.tolist() == pytest.approx([-1.65, -2.56, 0.4], abs=1e-6)
    assert logprobs.grad.tolist() == pytest.approx([-1.65, 0.0, 0.0], abs=1e-6)
    assert clipped.tolist() == [False, True, True]
    on_behaviour = {**batch, "old_logprobs": behaviour}  # the ratio against mu: another loss
    assert token_loss(on_behaviour, logprobs, torch.zeros(3), None, config)[0][0].item() == pytest.approx(-1.28)


def test_loss_aggregation_modes_by_hand_and_across_micro_batches():
    # per-token losses [1, 2, 3] (sequence 0) and [4] (sequence 1)
    loss, index = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 0, 1])
    assert aggregate(loss, index, "token-mean", 4, 2, 4).item() == pytest.approx(2.5)
    assert aggregate(loss, index, "seq-mean-token-mean", 4, 2, 4).item() == pytest.approx(3.0)  # (2 + 4) / 2
    assert aggregate(loss, index, "seq-mean-token-sum-norm", 4, 2, 4).item() == pytest.approx(1.25)  # 10 / (2*4)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(loss, index, mode, 4, 2, 4)
        halves = aggregate(loss[:3], index[:3], mode, 4, 2, 4) + aggregate(loss[3:], index[3:] * 0, mode, 4, 2, 4)
        assert halves.item() == pytest.approx(whole.item())


def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (37,))
    chunked, entropy = token_logprobs(hidden, head, targets, 0.7, chunk_tokens=8)
    chunked.sum().backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None
    full = torch.log_softmax(head(hidden) / 0.7, -1)
    full.gather(-1, targets[:, None])[:, 0].sum().backward()
    assert torch.allclose(chunked, full.gather(-1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(grad_chunked, hidden.grad, atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)


@pytest.fixture(scope="module")
def rollouts(tiny):
    model, tokenizer = tiny
    config = RunConfig(task={"rollouts": 8, "group_size": 8, "max_turns": 3}, generation={"max_new_tokens": 64})
    turns = run_episodes(
        HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode), tokenizer, config
    )
    # Fixed advantages: +1 for even rollouts, 0 for odd ones; returns 1 for even ones.
    advantages = [
        [1.0 if r % 2 == 0 else 0.0] * len(c) for r, c in zip(turns["rollout_id"], turns["completion_token_ids"])
    ]
    for name, column in (("advantages", advantages), ("returns", advantages)):
        turns = turns.add_column(name, column, feature=COMPUTE_ADVANTAGES[name])
    for name in ("values", "ref_logprobs"):
        turns = turns.add_column(name, [[] for _ in advantages], feature=COMPUTE_ADVANTAGES[name])
    return turns


def test_stored_generation_logprobs_equal_the_training_forward_pass(tiny, rollouts):
    model, tokenizer = tiny
    batch = collate(rollout_sequences(rollouts), tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logprobs, _, _ = forward_targets(model, batch, temperature=1.0, chunk_tokens=64)
    assert (logprobs - batch["generation_logprobs"]).abs().max().item() < 1e-4


def test_exact_generation_logprobs_stand_in_for_the_old_logprob_pass(tiny, rollouts):
    """ppo.recompute_old_logprobs=null skips the old-logprob forward pass for the hf engine in
    float32: ppo-update trains the policy that generated the rollouts, so the stored logprobs
    are the old ones within 1e-5, and the update is the same (weights within 1e-5, as packing)."""
    model, tokenizer = tiny
    batch = collate(rollout_sequences(rollouts), tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        recomputed, _, _ = forward_targets(model, batch, temperature=1.0, chunk_tokens=64)
    assert (recomputed - batch["generation_logprobs"]).abs().max().item() < 1e-5
    base = ppo_settings(learning_rate=1e-4, minibatch_rollouts=4, micro_batch_rollouts=2, epochs=1, kl_coef=0.0)
    results = {}
    for recompute in (True, False):
        trained = copy.deepcopy(model)
        config = base.model_copy(update={"recompute_old_logprobs": recompute})
        metrics = optimise_policy(trained, rollouts, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0)
        results[recompute] = (metrics, torch.cat([p.detach().flatten() for p in trained.parameters()]))
    (recomputed_metrics, recomputed_weights), (stored_metrics, stored_weights) = results[True], results[False]
    assert len(stored_metrics) == len(recomputed_metrics) == 2
    for stored, fresh in zip(stored_metrics, recomputed_metrics):
        assert stored["loss"] == pytest.approx(fresh["loss"], abs=1e-5)
        assert stored["grad_norm"] == pytest.approx(fresh["grad_norm"], rel=1e-4)
        assert stored["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)  # old = generation: nothing for TIS
    assert (stored_weights - recomputed_weights).abs().max() < 1e-5


def test_old_logprobs_are_recomputed_unless_generation_is_exact():
    def recomputes(**config) -> bool:
        return old_logprobs_recomputed(PPOSettings.resolve(RunConfig(**config)), stale=False)

    assert not recomputes()  # the hf engine in float32
    assert recomputes(model={"dtype": "bfloat16"})
    assert recomputes(generation={"engine": "another-engine"})
    assert recomputes(ppo={"recompute_old_logprobs": True})
    assert not recomputes(model={"dtype": "bfloat16"}, ppo={"recompute_old_logprobs": False})


def test_packed_rows_give_the_padded_logprobs_within_a_token_budget(tiny, rollouts):
    model, tokenizer = tiny
    sequences = rollout_sequences(rollouts)
    lengths = sorted(len(s.token_ids) for s in sequences)
    budget = lengths[-1] + lengths[0]  # the longest rollout plus the shortest fit in one bin
    bins = micro_batches(sequences, rollouts=3, max_tokens=budget)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in sequences)  # each exactly once
    assert all(sum(len(s.token_ids) for s in b) <= budget for b in bins) and len(bins) < len(sequences)
    with torch.no_grad():
        padded, padded_entropy, _ = forward_targets(
            model, collate(sequences, tokenizer.pad_token_id, torch.device("cpu")), 1.0, 64
        )
        by_sequence = {}
        for b in bins:
            batch = collate(b, tokenizer.pad_token_id, torch.device("cpu"), packed=True)
            assert batch["input_ids"].shape == (1, sum(len(s.token_ids) for s in b))  # one row, no padding
            logprobs, entropy, _ = forward_targets(model, batch, 1.0, 64)
            offset = 0
            for seq in b:
                n = len(seq.target_positions)
                by_sequence[id(seq)] = (logprobs[offset : offset + n], entropy[offset : offset + n])
                offset += n
    packed = torch.cat([by_sequence[id(s)][0] for s in sequences])
    packed_entropy = torch.cat([by_sequence[id(s)][1] for s in sequences])
    assert torch.allclose(packed, padded, atol=1e-5) and torch.allclose(packed_entropy, padded_entropy, atol=1e-4)


def test_packing_and_activation_checkpointing_do_not_change_the_update(tiny, rollouts):
    model, tokenizer = tiny
    # Every rollout with an advantage (-1 for the fixture's odd ones), so every one is computed.
    rollouts = rollouts.map(lambda r: {"advantages": [a or -1.0 for a in r["advantages"]]})
    base = ppo_settings(learning_rate=1e-4, minibatch_rollouts=4, micro_batch_rollouts=2, epochs=1, kl_coef=0.0)
    variants = {
        "padded": base,
        "packed": base.model_copy(update={"max_tokens_per_micro_batch": 1024}),
        "checkpointed": base.model_copy(update={"gradient_checkpointing": True}),
    }
    results, counted = {}, {}
    for name, config in variants.items():
        trained = copy.deepcopy(model)
        with counting_passes() as counted[name]:
            metrics = optimise_policy(trained, rollouts, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0)
        results[name] = (metrics, torch.cat([p.detach().flatten() for p in trained.parameters()]))
        assert not trained.is_activation_checkpointing
    # Each pass is counted: 8 rollouts, 2 a pass padded (4 passes); the old-logprob pass runs because
    # recompute_old_logprobs is null here (the caller knows no better); checkpointing runs every
    # training forward again in the backward pass; packing computes no padding.
    targets = sum(len(c) for c in rollouts["completion_token_ids"])
    padded = counted["padded"]
    assert set(padded) == {"old_logprobs", "training_forward", "training_backward"}
    assert all(c["passes"] == 4 and c["targets"] == targets for c in padded.values())
    assert counted["checkpointed"]["training_recomputed_forward"] == padded["training_forward"]
    packed = counted["packed"]["training_forward"]
    assert packed["tokens"] == packed["padded_tokens"] < padded["training_forward"]["padded_tokens"]
    for name in ("packed", "checkpointed"):
        metrics, weights = results[name]
        for ours, padded in zip(metrics, results["padded"][0]):
            assert ours["loss"] == pytest.approx(padded["loss"], abs=1e-5)
            assert ours["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-3)
        assert (weights - results["padded"][1]).abs().max() < 1e-5


def test_one_ppo_step_lowers_the_loss_and_raises_positive_advantage_logprobs(tiny, rollouts):
    model, tokenizer = tiny
    trained = copy.deepcopy(model)
    sequences = rollout_sequences(rollouts)
    for seq in sequences:
        seq.old_logprobs = seq.generation_logprobs
    batch = collate(sequences, tokenizer.pad_token_id, torch.device("cpu"))
    # A small step, so that the first-order picture holds: Adam's first step is along -sign(grad).
    config = ppo_settings(
        learning_rate=1e-4, minibatch_rollouts=len(sequences), micro_batch_rollouts=3, epochs=1, kl_coef=0.0
    )

    def evaluate(m):
        with torch.no_grad():
            logprobs, _, _ = forward_targets(m, batch, 1.0, 64)
            per_token, _ = policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], 0.2, 0.28, 3.0)
        return per_token.mean().item(), logprobs

    loss_before, before = evaluate(trained)
    metrics = optimise_policy(trained, rollouts, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0)
    loss_after, after = evaluate(trained)
    assert len(metrics) == 1 and metrics[0]["grad_norm"] > 0
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # same weights, same kernels
    assert loss_after < loss_before
    assert (after - before)[batch["advantages"] > 0].mean() > 0


def test_value_head_learns_the_returns_and_kl_in_the_loss_runs(tiny, rollouts):
    model, tokenizer = tiny
    trained, head = copy.deepcopy(model), ValueHead(model.config.hidden_size)
    reference_logprobs, values = score_rollouts(
        model,
        rollouts,
        temperature=1.0,
        pad_token_id=tokenizer.pad_token_id,
        chunk_tokens=64,
        batch_rollouts=4,
        value_head=head,
    )
    assert all(v == 0.0 for row in values for v in row)  # a fresh head predicts 0
    data = rollouts.remove_columns(["values", "ref_logprobs"])
    data = data.add_column("values", values, feature=COMPUTE_ADVANTAGES["values"])
    data = data.add_column("ref_logprobs", reference_logprobs, feature=COMPUTE_ADVANTAGES["ref_logprobs"])
    config = ppo_settings(learning_rate=1e-3, minibatch_rollouts=4, epochs=3, kl_coef=0.1, value_clip=None)
    metrics = optimise_policy(
        trained, data, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0, value_head=head
    )
    assert metrics[-1]["value_loss"] < metrics[0]["value_loss"]
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-4) and metrics[-1]["kl"] > 0


def test_the_value_loss_trains_the_head_and_never_the_policy(tiny, rollouts):
    # Zero advantages and no entropy or KL term: the only loss is the critic's. The policy's
    # weights must come out bit-identical (the head reads detached features) while the head
    # moves toward the returns.
    model, tokenizer = tiny
    trained, head = copy.deepcopy(model), ValueHead(model.config.hidden_size)
    zeros = [[0.0] * len(c) for c in rollouts["completion_token_ids"]]
    data = rollouts.remove_columns(["advantages", "values"])
    data = data.add_column("advantages", zeros, feature=COMPUTE_ADVANTAGES["advantages"])
    data = data.add_column("values", zeros, feature=COMPUTE_ADVANTAGES["values"])
    config = ppo_settings(learning_rate=1e-2, minibatch_rollouts=4, epochs=2, value_clip=None, kl_coef=0.0)
    metrics = optimise_policy(
        trained, data, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0, value_head=head
    )
    assert all(m["value_grad_norm"] > 0 for m in metrics) and all(m["grad_norm"] == 0 for m in metrics)
    for (name, before), after in zip(model.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(before, after), name
    assert head.linear.bias.item() > 0  # returns are 1 or 0, V started at 0


def test_saved_optimizer_state_continues_adam_exactly_across_iterations(tiny, rollouts, tmp_path):
    # Two updates with one AdamW kept in memory == two updates with its state saved after the
    # first and loaded into a new optimiser (what two iterations of the flow do); a fresh
    # optimiser for the second update gives different weights (so the state matters).
    model, tokenizer = tiny
    config = ppo_settings(learning_rate=1e-3, minibatch_rollouts=8, micro_batch_rollouts=8, kl_coef=0.0)

    def update(policy, optimizer, seed):
        optimise_policy(
            policy,
            rollouts,
            settings=config,
            pad_token_id=tokenizer.pad_token_id,
            seed=seed,
            optimizer=optimizer,
        )

    kept = copy.deepcopy(model)
    optimizer = build_optimizer(kept, config)
    update(kept, optimizer, 0)
    update(kept, optimizer, 1)

    resumed = copy.deepcopy(model)
    first = build_optimizer(resumed, config)
    update(resumed, first, 0)
    save_optimizer_state(first, resumed, None, tmp_path)
    fresh = copy.deepcopy(resumed)
    second = build_optimizer(resumed, config)
    assert load_optimizer_state(second, resumed, None, tmp_path) == len(list(resumed.parameters()))
    update(resumed, second, 1)
    update(fresh, build_optimizer(fresh, config), 1)

    for (name, a), b in zip(kept.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(kept.state_dict().values(), fresh.state_dict().values()))
    assert load_optimizer_state(build_optimizer(model, config), model, None, tmp_path / "none") == 0


def test_memory_settings_follow_the_model_size_unless_set():
    from stages.policy.batching import LARGE_MODEL_TOKENS_PER_MICRO_BATCH, memory_settings

    unset = ppo_settings()
    small, large = memory_settings(unset, large=False), memory_settings(unset, large=True)
    assert (small.gradient_checkpointing, small.max_tokens_per_micro_batch) == (False, 0)
    assert (large.gradient_checkpointing, large.max_tokens_per_micro_batch) == (
        True,
        LARGE_MODEL_TOKENS_PER_MICRO_BATCH,
    )
    on_gpu = memory_settings(unset, large=True, on_gpu=True)  # a GPU: padded passes, faster there
    assert (on_gpu.gradient_checkpointing, on_gpu.max_tokens_per_micro_batch) == (True, 0)
    chosen = ppo_settings(gradient_checkpointing=False, max_tokens_per_micro_batch=512)
    assert memory_settings(chosen, large=True) == chosen  # what the user set is kept


def test_the_size_rule_counts_the_saved_models_parameters(tiny):
    """One count for ppo-update and sft: the safetensors headers of the saved policy, equal to the
    loaded model's parameters (no weights are loaded to count them)."""
    from pipeline.models.base_model import EMBEDDED_POLICY
    from stages.policy.batching import LARGE_MODEL_PARAMETERS, large_model
    from stages.policy.loading import load_model, parameter_count

    count = parameter_count(EMBEDDED_POLICY)
    assert count == sum(p.numel() for p in load_model(EMBEDDED_POLICY, "float32", "cpu").parameters())
    assert large_model(EMBEDDED_POLICY) is (count >= LARGE_MODEL_PARAMETERS) is False


# ---------------------------------------------------------------------------------------
# Shared-prefix passes: a common prompt computed once, the same numbers
# ---------------------------------------------------------------------------------------


def tiny_llama() -> torch.nn.Module:
    """A random Llama-shaped policy (grouped-query attention, rotary positions), the architecture
    of SmolLM2; the embedded policy is Qwen3-shaped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # logits of order 1, so that a wrong position or mask shows
    )
    return LlamaForCausalLM(config).eval()


def hand_built_group(vocab_size: int) -> list[RolloutSequence]:
    """Rollouts of one prompt as a group makes them, and the cases around it: members whose first
    completion tokens agree, an identical pair, a two-turn rollout, one that shares half the
    prompt and one that shares nothing."""
    rng = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=rng).tolist()

    prompt, opening = tokens(40), tokens(3)  # `opening`: the same first completion tokens
    sequences = []
    for length in (9, 25, 17, 4):
        completion = opening + tokens(length)
        sequences.append(
            RolloutSequence(token_ids=prompt + completion, target_positions=list(range(40, 40 + len(completion))))
        )
    sequences.append(copy.deepcopy(sequences[0]))
    two_turns = RolloutSequence(
        token_ids=list(sequences[1].token_ids), target_positions=list(sequences[1].target_positions)
    )
    second = tokens(6)
    two_turns.token_ids += tokens(5) + second  # the observation and the generation prompt, then the second completion
    two_turns.target_positions += range(len(two_turns.token_ids) - len(second), len(two_turns.token_ids))
    sequences.append(two_turns)
    sequences.append(RolloutSequence(token_ids=prompt[:20] + tokens(12), target_positions=list(range(24, 32))))
    sequences.append(
        RolloutSequence(token_ids=[(prompt[0] + 1) % vocab_size] + tokens(15), target_positions=[10, 11, 12])
    )
    for seq in sequences:
        n = len(seq.target_positions)
        seq.advantages = torch.linspace(-1.0, 1.0, n).tolist()
    return sequences


@pytest.mark.parametrize("architecture", ["embedded (Qwen3)", "Llama"])
def test_shared_prefix_passes_give_the_unshared_logprobs_values_and_gradients(tiny, architecture):
    model = copy.deepcopy(tiny[0]) if architecture.startswith("embedded") else tiny_llama()
    assert shares_prefix(model)
    sequences = hand_built_group(model.config.vocab_size)
    value_head = ValueHead(model.config.hidden_size)
    torch.manual_seed(0)
    torch.nn.init.normal_(value_head.linear.weight, std=0.05)  # values of order 1, as returns

    def run(packed: bool, share_prefix: bool):
        model.zero_grad(), value_head.zero_grad()
        batch = collate(sequences, 0, torch.device("cpu"), packed=packed, share_prefix=share_prefix)
        logprobs, entropy, values = forward_targets(model, batch, 0.7, 16, value_head)
        ((logprobs + 0.1 * entropy) * batch["advantages"]).sum().add(values.square().sum()).backward()
        grads = [p.grad.clone() for p in [*model.parameters(), *value_head.parameters()]]
        computed = int((batch["input_ids"] != 0).sum()) if not packed else batch["input_ids"].numel()
        return logprobs.detach(), entropy.detach(), values.detach(), grads, computed

    reference = run(packed=False, share_prefix=False)
    unshared_tokens = sum(len(s.token_ids) for s in sequences)
    for packed in (False, True):
        logprobs, entropy, values, grads, computed = run(packed, share_prefix=True)
        assert (logprobs - reference[0]).abs().max() < 1e-5
        assert (entropy - reference[1]).abs().max() < 1e-4
        assert (values - reference[2]).abs().max() < 1e-5
        for ours, unshared in zip(grads, reference[3]):  # per parameter, relative to its largest gradient
            assert (ours - unshared).abs().max() <= 1e-5 * unshared.abs().max() + 1e-8
        if packed:  # the prompt once: 40 + 40 + 40 ... tokens fewer
            assert computed <= unshared_tokens - 4 * 40


def test_a_prefix_is_shared_while_it_saves_tokens_and_never_holds_a_predicted_token():
    def seq(tokens: list[int], first_target: int) -> RolloutSequence:
        return RolloutSequence(token_ids=tokens, target_positions=list(range(first_target, len(tokens))))

    a, b = seq([1, 2, 3, 4, 5, 10, 11], 5), seq([1, 2, 3, 4, 5, 12, 13], 5)
    c, d = seq([1, 2, 3, 9, 14], 4), seq([7, 7, 7], 2)
    # a and b share 5 tokens, but the 5th predicts their first target: 4 are shared; c shares 3
    # with them (3 x 3 >= 2 x 4: it joins), d nothing.
    assert common_prefix_length([a, b]) == 4 and common_prefix_length([a, b, c]) == 3
    assert [[id(s) for s in unit] for unit in prefix_units([d, c, b, a])] == [[id(a), id(b), id(c)], [id(d)]]
    assert computed_tokens([a, b, c]) == 3 + 4 + 4 + 2
    # Three members sharing 10 tokens keep them rather than take in one that shares 2 (3 x 2 < 2 x 10).
    members = [seq(list(range(1, 11)) + [20 + i, 30], 11) for i in range(3)]
    newcomer = seq([1, 2, 99, 98, 97], 3)
    assert [len(unit) for unit in prefix_units([*members, newcomer])] == [3, 1]
    # A row's attention is dense: long remainders sharing a short prompt go two to a row (under
    # twice the longest sequence, 3000 tokens: 100 + 2 x 1400), not six in one 8500-token row.
    long = [seq(list(range(100)) + [1000 + i] * 1400, 100) for i in range(6)]
    assert [len(unit) for unit in prefix_units(long)] == [2, 2, 2]


def test_shared_micro_batches_hold_each_rollout_once_within_the_token_budget(tiny):
    sequences = hand_built_group(tiny[0].config.vocab_size)
    budget = 130
    bins = micro_batches(sequences, rollouts=4, max_tokens=budget, share_prefix=True)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in sequences)
    for b in bins:
        assert sum(computed_tokens(unit) for unit in prefix_units(b)) <= budget or len(b) == 1
    assert len(bins) < len(micro_batches(sequences, rollouts=4, max_tokens=budget))


def test_a_batch_that_shares_nothing_collates_as_an_unshared_one(tiny):
    sequences = hand_built_group(tiny[0].config.vocab_size)
    alone = [sequences[0], sequences[-1]]  # no common first token
    for packed in (False, True):
        shared = collate(alone, 0, torch.device("cpu"), packed=packed, share_prefix=True)
        unshared = collate(alone, 0, torch.device("cpu"), packed=packed, share_prefix=False)
        assert shared.keys() == unshared.keys()
        assert all(torch.equal(shared[k], unshared[k]) for k in shared)
    assert collate(sequences[:2], 0, torch.device("cpu"), share_prefix=True)["attention_mask"].dim() == 4


def test_models_whose_attention_takes_no_shared_mask_are_scored_unshared():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    assert not shares_prefix(Qwen3ForCausalLM(config))  # sliding-window layers: a custom mask would drop the window
    llama = tiny_llama()
    llama.config._attn_implementation = "flash_attention_2"  # takes no custom mask
    assert not shares_prefix(llama)


def test_a_shared_prefix_update_and_scores_equal_the_unshared_ones(tiny, rollouts):
    model, tokenizer = tiny
    head = ValueHead(model.config.hidden_size)
    torch.manual_seed(0)
    torch.nn.init.normal_(head.linear.weight, std=0.05)
    scores = {
        share: score_rollouts(
            model,
            rollouts,
            temperature=1.0,
            pad_token_id=tokenizer.pad_token_id,
            chunk_tokens=64,
            batch_rollouts=4,
            value_head=head,
            share_prefix=share,
        )
        for share in (False, True)
    }
    for shared, unshared in zip(scores[True], scores[False]):
        assert max(abs(x - y) for a, b in zip(shared, unshared) for x, y in zip(a, b)) < 1e-5
    base = ppo_settings(learning_rate=1e-4, minibatch_rollouts=4, micro_batch_rollouts=2, epochs=1, kl_coef=0.0)
    weights = {}
    for name, update in {
        "unshared": {"share_prefix": False},
        "shared, padded": {},
        "shared, packed": {"max_tokens_per_micro_batch": 400},
    }.items():
        trained = copy.deepcopy(model)
        optimise_policy(
            trained,
            rollouts,
            settings=base.model_copy(update=update),
            pad_token_id=tokenizer.pad_token_id,
            seed=0,
        )
        weights[name] = torch.cat([p.detach().flatten() for p in trained.parameters()])
    for name in ("shared, padded", "shared, packed"):
        assert (weights[name] - weights["unshared"]).abs().max() < 1e-5, name


def test_a_batch_without_a_sampled_token_is_a_clear_error(tiny, rollouts):
    model, tokenizer = tiny
    all_failed = rollouts.map(lambda row: {"failed": True})
    with pytest.raises(ValueError, match=r"nothing to train on: .* \(8 rollouts failed"):
        optimise_policy(model, all_failed, settings=ppo_settings(), pad_token_id=tokenizer.pad_token_id, seed=0)


def test_rollouts_without_advantage_are_not_computed_and_the_update_stays_the_same(tiny, rollouts):
    """Rollouts of advantage 0 (6 of the 8) add exactly nothing with no KL, entropy or value term, so
    no pass computes them. The reference computes them: advantages of 1e-30 instead of 0 (a
    gradient 1e-30 times as large), the loss normalised over the same tokens."""
    model, tokenizer = tiny

    def update(turns, **settings) -> tuple[torch.Tensor, dict, list[dict]]:
        trained = copy.deepcopy(model)
        config = ppo_settings(learning_rate=1e-4, minibatch_rollouts=2, micro_batch_rollouts=2, kl_coef=0.0, **settings)
        with counting_passes() as passes:
            metrics = optimise_policy(trained, turns, settings=config, pad_token_id=tokenizer.pad_token_id, seed=0)
        return torch.cat([p.detach().flatten() for p in trained.parameters()]), passes, metrics

    def advantages(turns, silent: float, everyone: bool = False):
        def row(r):
            zero = everyone or r["rollout_id"] % 4 != 0
            return {"advantages": [silent if zero else a for a in r["advantages"]]}

        return turns.map(row)

    targets = {r: 0 for r in rollouts["rollout_id"]}
    for r, completion in zip(rollouts["rollout_id"], rollouts["completion_token_ids"]):
        targets[r] += len(completion)
    skipped, skipped_passes, skipped_metrics = update(advantages(rollouts, 0.0))
    computed, computed_passes, _ = update(advantages(rollouts, 1e-30))
    assert (skipped - computed).abs().max() < 1e-5  # lr 1e-4: float rounding, as between pass layouts
    assert skipped_passes["training_forward"]["targets"] == sum(n for r, n in targets.items() if r % 4 == 0)
    assert computed_passes["training_forward"]["targets"] == sum(targets.values())
    # 4 mini-batches of 2, 2 rollouts with advantage: at least two steps compute nothing, and Adam
    # still steps there (with the state of the steps before).
    assert [m["rollouts_computed"] for m in skipped_metrics].count(0) >= 2
    # Nothing to learn: no pass at all, and still the computed update.
    silent, silent_passes, _ = update(advantages(rollouts, 0.0, everyone=True), weight_decay=0.1)
    reference, _, _ = update(advantages(rollouts, 1e-30, everyone=True), weight_decay=0.1)
    assert silent_passes == {} and (silent - reference).abs().max() < 1e-5
    assert not torch.equal(silent, torch.cat([p.detach().flatten() for p in model.parameters()]))  # decayed
    # An entropy bonus reads every rollout: all are computed.
    _, with_entropy, _ = update(rollouts, entropy_coef=0.01)
    assert with_entropy["training_forward"]["targets"] == sum(targets.values())
