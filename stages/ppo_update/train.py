"""The update of ppo-update: recompute logprobs under the current policy and optimise the clipped
PPO objective (Schulman et al. 2017, arXiv:1707.06347) on the tokens the policy sampled; one metrics
row per optimiser step. It runs in the stage's process or in each rank of several (worker.py).

Read top to bottom:
  0. the settings: exactly the run-config fields ppo-update reads;
  1. pure functions: the policy loss (clip-higher, dual clip), the value loss, the truncated
     importance-sampling weight, the per-token loss, loss aggregation modes;
  2. the optimisation loop: epochs x shuffled mini-batches x gradient-accumulated micro-batches,
     one training sequence per rollout (its whole token stream; the loss covers completion tokens
     only, never prompts, observations or generation prompts), padded rows or packed into a
     token budget (stages/policy/batching.py);
  3. train_policy: from a stored policy to the next one, ready to save.

Loading, batching and scoring a policy are stages/policy/'s; saving it with its AdamW state is
checkpoint.py's. Convention: logprob = log_softmax(logits / temperature)[token], as at generation time.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from runtime.passes import count_pass
from schemas.stage import Settings, read
from stages.policy.batching import (
    RolloutSequence,
    collate,
    memory_settings,
    micro_batches,
    rollout_sequences,
    shares_prefix,
    training_memory,
)
from stages.policy.loading import TRANSFORMERS_GLOBALS, Device, ValueHead, load_model, load_tokenizer
from stages.policy.scoring import Scorer, kl_estimate
from stages.ppo_update.checkpoint import load_optimizer_state, optimizer_tensors, save_policy
from stages.sharding import SINGLE, Ranks, grad_norm, passes, shard_model


class PPOSettings(Settings):
    learning_rate: float = read("ppo.learning_rate")
    weight_decay: float = read("ppo.weight_decay")
    epochs: int = read("ppo.epochs")
    minibatch_rollouts: int = read("ppo.minibatch_rollouts")
    micro_batch_rollouts: int = read("ppo.micro_batch_rollouts")
    max_tokens_per_micro_batch: int | None = read("ppo.max_tokens_per_micro_batch")  # null: the memory rule
    share_prefix: bool = read("ppo.share_prefix")
    gradient_checkpointing: bool | None = read("ppo.gradient_checkpointing")  # null: the memory rule
    clip_low: float = read("ppo.clip_low")
    clip_high: float = read("ppo.clip_high")
    clip_ratio_c: float | None = read("ppo.clip_ratio_c")
    loss_aggregation: str = read("ppo.loss_aggregation")
    loss_norm_tokens: int = read("ppo.loss_norm_tokens")
    entropy_coef: float = read("ppo.entropy_coef")
    kl_coef: float = read("ppo.kl_coef")
    kl_estimator: str = read("ppo.kl_estimator")
    kl_in: str = read("ppo.kl_in")
    value_coef: float = read("ppo.value_coef")
    value_clip: float | None = read("ppo.value_clip")
    recompute_old_logprobs: bool | None = read("ppo.recompute_old_logprobs")  # null: run() decides
    tis_cap: float = read("ppo.tis_cap")
    max_grad_norm: float = read("ppo.max_grad_norm")
    logprob_chunk_tokens: int = read("ppo.logprob_chunk_tokens")
    autocast: str = read("ppo.autocast")
    lora_rank: int = read("ppo.lora_rank")
    lora_alpha: float = read("ppo.lora_alpha")
    # Each rank's share and the order gradients are summed in: the same update up to float rounding.
    world_size: int = read("ppo.world_size")
    seed: int = read("seed")
    temperature: float = read("generation.temperature")
    device: Device = read("model.device")
    # which logprobs generation stored: the hf engine in float32 stores the policy's own
    generation_engine: str = read("generation.engine")
    generation_dtype: str = read("model.dtype")
    # A fresh AdamW in place of a pruned state (pipeline/store/retention.py): on only where it takes effect.
    fresh_optimizer: bool = read("store.fresh_optimizer_if_pruned")
    # Where the ranks run, not what they compute (tested equal within float rounding), and when a hung
    # job fails: not part of the version.
    nodes: int = read("ppo.nodes", placement=True)
    ray_address: str | None = read("runner.ray_address", placement=True)
    requested_device: str = read("model.device", placement=True)  # auto: a GPU per rank where a node has one
    collective_timeout_s: float = read("ppo.collective_timeout_s", placement=True)


# ---------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -A*ratio with the ratio clipped to [1-clip_low, 1+clip_high]:
    PPO (Schulman et al. 2017, arXiv:1707.06347), with a wider upper clip as DAPO's clip-higher
    (Yu et al. 2025, arXiv:2503.14476). Dual clip (Ye et al. 2019, "Mastering Complex Control in
    MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729) bounds the loss of negative
    advantages by -A*clip_ratio_c.
    Returns (loss per token, whether the clip was active per token)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if clip_ratio_c is not None:
        dual = torch.minimum(loss, -advantages * clip_ratio_c)
        was_clipped = was_clipped | ((advantages < 0) & (dual < loss))
        loss = torch.where(advantages < 0, dual, loss)
    return loss, was_clipped


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Per-token 0.5 * (V - R)^2, optionally the max with the clipped version: the value clipping of
    OpenAI Baselines' PPO2, which the PPO paper does not describe (studied in Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients", arXiv:2005.12729)."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


def truncated_is_weight(old_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling weight min(pi_old / pi_generation, cap) per token: the
    sampler's logprobs differ from the trainer's once weights or kernels differ. From Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (a blog post,
    no arXiv id, https://fengyao.notion.site/off-policy-rl)."""
    return torch.exp(old_logprobs - generation_logprobs).clamp(max=cap)


def token_loss(
    batch: dict[str, torch.Tensor],
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    values: torch.Tensor | None,
    settings: PPOSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-token total loss and its terms, before aggregation:

        total = w * clipped_surrogate - entropy_coef * H (+ kl_coef * KL) (+ value_coef * value loss)

    with w the truncated IS weight. KL enters when settings.kl_in == "loss" and kl_coef > 0;
    the value loss when `values` (the critic's) are given.
    Returns (total, {term name: per-token value}, whether the ratio clip was active, w)."""
    surrogate, was_clipped = policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        settings.clip_low,
        settings.clip_high,
        settings.clip_ratio_c,
    )
    is_weight = truncated_is_weight(batch["old_logprobs"], batch["generation_logprobs"], settings.tis_cap)
    weighted = surrogate * is_weight
    total = weighted - settings.entropy_coef * entropy
    terms = {"policy_loss": weighted, "entropy": entropy}
    if settings.kl_coef > 0 and settings.kl_in == "loss":
        terms["kl"] = kl_estimate(logprobs, batch["ref_logprobs"], settings.kl_estimator)
        total = total + settings.kl_coef * terms["kl"]
    if values is not None:
        terms["value_loss"] = value_loss(values, batch["old_values"], batch["returns"], settings.value_clip)
        total = total + settings.value_coef * terms["value_loss"]
    return total, terms, was_clipped, is_weight


def aggregate(
    per_token: torch.Tensor,
    sequence_index: torch.Tensor,
    mode: str,
    minibatch_tokens: int,
    minibatch_sequences: int,
    norm_tokens: int,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss, so shares sum to the mini-batch value:
    token-mean                sum over tokens / tokens in the mini-batch
                              (DAPO's token-level loss, Yu et al. 2025, arXiv:2503.14476)
    seq-mean-token-mean       sum over sequences of (mean over its tokens) / sequences
                              (GRPO's objective, Shao et al. 2024, arXiv:2402.03300)
    seq-mean-token-sum-norm   sum over tokens / (sequences * norm_tokens)
                              (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)"""
    if mode == "token-mean":
        return per_token.sum() / minibatch_tokens
    if mode == "seq-mean-token-mean":
        counts = torch.bincount(sequence_index).clamp(min=1).to(per_token.dtype)
        sums = torch.zeros_like(counts).index_add(0, sequence_index, per_token)
        return (sums / counts).sum() / minibatch_sequences
    if mode == "seq-mean-token-sum-norm":
        return per_token.sum() / (minibatch_sequences * norm_tokens)
    raise ValueError(f"unknown loss aggregation '{mode}'")


# ---------------------------------------------------------------------------------------
# 2. The optimisation loop
# ---------------------------------------------------------------------------------------


def build_optimizer(
    model: torch.nn.Module, settings: PPOSettings, value_head: ValueHead | None = None
) -> torch.optim.AdamW:
    """AdamW over the policy's trainable parameters (group 0) and the critic's (group 1)."""
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters())})
    return torch.optim.AdamW(groups, lr=settings.learning_rate, weight_decay=settings.weight_decay)


def _autocast(device: torch.device, mode: str):
    use_bf16 = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def optimise_policy(
    model: torch.nn.Module,
    turns: datasets.Dataset,
    *,
    settings: PPOSettings,
    pad_token_id: int,
    seed: int,
    value_head: ValueHead | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    report_progress: Callable[[float], None] | None = None,
    ranks: Ranks = SINGLE,
) -> list[dict[str, float]]:
    """Optimise `model` (and `value_head`, when given) in place on one iteration's rollouts.
    `optimizer` (from build_optimizer, with the previous iteration's state loaded) continues
    one AdamW across iterations, as TRL and verl do; without it a fresh one is built, whose
    first steps move every parameter by about the learning rate (Adam's bias correction), noise
    included. `report_progress` is called after every optimiser step with the share of the
    steps done. Returns one metrics dict per optimiser step.

    With `ranks` of several processes (stages/sharding.py: `model` sharded by shard_model, the
    same `turns` and `seed` on every rank) each rank runs its share of every mini-batch and
    the metrics are global: the same rows as one process, up to float rounding."""
    torch.manual_seed(seed)
    scorer = model if isinstance(model, Scorer) else Scorer(model)  # a sharded model comes as its Scorer
    device = next(model.parameters()).device
    sequences = [s for s in rollout_sequences(turns) if s.target_positions]
    if not sequences:  # a clear error here, not a reshape of an empty batch further down
        failed = len({rollout for rollout, f in zip(turns["rollout_id"], turns["failed"]) if f})
        raise ValueError(
            f"nothing to train on: no rollout of these {turns.num_rows} rows has a sampled token "
            f"({failed} rollouts failed; the others, if any, have no completion tokens)"
        )
    train_value = value_head is not None and all(len(s.old_values) == len(s.target_positions) for s in sequences)
    use_kl_loss = settings.kl_coef > 0 and settings.kl_in == "loss"
    if use_kl_loss and not all(len(s.ref_logprobs) == len(s.target_positions) for s in sequences):
        raise ValueError("kl_in='loss' needs ref_logprobs in the compute-advantages dataset")

    settings = memory_settings(settings, large=False)  # null memory fields: off (train_policy chose them by size)
    # A rollout whose advantages are all 0 adds exactly 0 to the loss and its gradient when no other
    # term reads it (no KL in the loss, no entropy bonus, no critic): no pass computes it, and the loss
    # keeps its tokens in the normaliser, so the update is the one over every rollout. (With sparse
    # rewards most groups score alike; DAPO drops them from the batch instead, changing the normaliser.)
    inert_without_advantage = not use_kl_loss and settings.entropy_coef == 0 and not train_value

    def computed(share: list[RolloutSequence]) -> list[RolloutSequence]:
        if not inert_without_advantage:
            return share
        return [s for s in share if any(a != 0 for a in s.advantages)]

    # Old logprobs: the policy before this update, recomputed by the training forward pass;
    # generation logprobs differ once kernels or precision differ, which TIS corrects for.
    packed = settings.max_tokens_per_micro_batch > 0
    share_prefix = settings.share_prefix and shares_prefix(scorer.model)

    def split(share: list[RolloutSequence]) -> list[list[RolloutSequence]]:
        return micro_batches(share, settings.micro_batch_rollouts, settings.max_tokens_per_micro_batch, share_prefix)

    def collated(chunk: list[RolloutSequence]) -> dict[str, torch.Tensor]:
        return collate(chunk, pad_token_id, device, packed, share_prefix)

    if settings.recompute_old_logprobs is not False:  # null: the caller knows no better (run() resolves it)
        scored = computed(sequences)
        for chunk, weight in passes(scored, ranks, split):
            batch = collated(chunk)
            count_pass("old_logprobs", batch)
            with torch.no_grad(), _autocast(device, settings.autocast):
                logprobs, _, _ = scorer(batch, settings.temperature, settings.logprob_chunk_tokens)
            offset = 0
            for seq in chunk if weight else []:
                seq.old_logprobs = logprobs[offset : offset + len(seq.target_positions)].tolist()
                offset += len(seq.target_positions)
        # Each rank scored its share; the shuffled mini-batches mix the shares, so all ranks get all.
        for rank, gathered in enumerate(ranks.gather([seq.old_logprobs for seq in ranks.share(scored)])):
            for seq, old_logprobs in zip(scored[rank :: ranks.world_size], gathered):
                seq.old_logprobs = old_logprobs
    else:
        for seq in sequences:
            seq.old_logprobs = list(seq.generation_logprobs)

    optimizer = optimizer or build_optimizer(model, settings, value_head)
    parameters = optimizer.param_groups[0]["params"]
    critic_parameters = optimizer.param_groups[1]["params"] if train_value else []
    shuffle = random.Random(seed)
    n_steps = settings.epochs * -(-len(sequences) // settings.minibatch_rollouts)
    metrics: list[dict[str, float]] = []
    progress = tqdm(total=n_steps, desc="ppo-update", unit="step", leave=False, disable=None)
    # Recompute each layer's activations in backward: less memory, about 1/3 more compute.
    if settings.gradient_checkpointing:
        scorer.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    scorer.train()
    # Mini-batches of shuffled rollouts, not whole groups: with sparse rewards most groups have no
    # advantage, and a step on two such groups moves every weight by about the learning rate in a
    # direction of noise (Adam's step size does not shrink with the gradient). Rollouts of other
    # groups still share their system prompt and tools in a pass (prefix_units).
    for epoch in range(settings.epochs):
        order = list(range(len(sequences)))
        shuffle.shuffle(order)
        for start in range(0, len(order), settings.minibatch_rollouts):
            minibatch = [sequences[i] for i in order[start : start + settings.minibatch_rollouts]]
            minibatch_tokens = sum(len(s.target_positions) for s in minibatch)
            trained = computed(minibatch)
            trained_tokens = sum(len(s.target_positions) for s in trained)
            over_computed = (trained_tokens, len(trained), settings.loss_norm_tokens)  # the diagnostics' means
            sums: dict[str, float] = {}
            optimizer.zero_grad(set_to_none=True)
            # weight 0: a pass this rank repeats so that it runs as many as the busiest rank
            for micro, weight in passes(trained, ranks, split):
                batch = collated(micro)
                for kind in ("training_forward", "training_backward"):
                    count_pass(kind, batch)
                if settings.gradient_checkpointing:  # the backward pass runs each layer's forward again
                    count_pass("training_recomputed_forward", batch)
                with _autocast(device, settings.autocast):
                    logprobs, entropy, values = scorer(
                        batch, settings.temperature, settings.logprob_chunk_tokens, value_head if train_value else None
                    )
                total, terms, was_clipped, is_weight = token_loss(batch, logprobs, entropy, values, settings)
                shares = {"loss": total, **terms}
                by = (batch["sequence_index"], settings.loss_aggregation)
                objective = aggregate(total, *by, minibatch_tokens, len(minibatch), settings.loss_norm_tokens)
                (objective * weight).backward()
                with torch.no_grad():  # diagnostics: means over the rollouts this step computed
                    log_ratio = logprobs - batch["old_logprobs"]
                    diagnostics = {
                        **{name: aggregate(value.detach(), *by, *over_computed) for name, value in shares.items()},
                        "clip_fraction": was_clipped.float().sum() / trained_tokens,
                        "approx_kl": ((torch.exp(log_ratio) - 1.0) - log_ratio).sum() / trained_tokens,
                        "ratio_mean": torch.exp(log_ratio).sum() / trained_tokens,
                        "is_weight_mean": is_weight.sum() / trained_tokens,
                        "logprob_mismatch": (batch["old_logprobs"] - batch["generation_logprobs"]).abs().sum()
                        / trained_tokens,
                    }
                for name, value in diagnostics.items():
                    sums[name] = sums.get(name, 0.0) + weight * float(value)
                sums["ratio_max"] = max(sums.get("ratio_max", 0.0), weight * float(torch.exp(log_ratio).max()))
                sums["is_weight_max"] = max(sums.get("is_weight_max", 0.0), weight * float(is_weight.max()))
            sums = ranks.reduce_metrics(sums)
            for parameter in parameters if not trained else []:  # Adam still steps on a zero gradient
                parameter.grad = torch.zeros_like(parameter)
            ranks.sum_gradients(critic_parameters)  # the value head is replicated, not sharded
            # Clipped apart: the critic's gradient must not shrink the policy's step.
            policy_grad_norm = grad_norm(parameters, settings.max_grad_norm)
            if critic_parameters:
                sums["value_grad_norm"] = grad_norm(critic_parameters, settings.max_grad_norm)
            optimizer.step()
            metrics.append(
                {
                    "epoch": epoch,
                    "step": len(metrics),
                    "rollouts": len(minibatch),
                    "rollouts_computed": len(trained),
                    "tokens": minibatch_tokens,
                    "learning_rate": settings.learning_rate,
                    "grad_norm": policy_grad_norm,
                    **sums,
                }
            )
            progress.update()
            if report_progress is not None:
                report_progress(len(metrics) / n_steps)
    progress.close()
    optimizer.zero_grad(set_to_none=True)  # the last step's gradients: no longer needed, free them
    if settings.gradient_checkpointing:
        scorer.model.activation_checkpointing_disable()
    scorer.eval()
    return metrics


def metrics_summary(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the optimiser steps (for the manifest)."""
    if not metrics:
        return {}
    names = dict.fromkeys(name for m in metrics for name in m if name not in ("epoch", "step"))
    # A step that computed no rollout has no diagnostics: the means are over the steps that have them.
    return {name: float(np.mean([m[name] for m in metrics if name in m])) for name in names}


# ---------------------------------------------------------------------------------------
# 3. From a stored policy to the next one
# ---------------------------------------------------------------------------------------


@dataclass
class TrainedPolicy:
    model: torch.nn.Module  # unsharded (on rank 0 of several processes; the other ranks save nothing)
    tokenizer: Any
    value_head: ValueHead | None
    optimizer_state: dict[str, torch.Tensor] | None  # whole AdamW tensors by parameter name (None: LoRA)
    metrics: list[dict[str, float]]  # one row per optimiser step
    optimizer_state_restored: int  # parameters whose AdamW state continued (0: a fresh optimiser)

    def save(self, directory: Path) -> dict[str, Any]:
        save_policy(directory, self.model, self.tokenizer, self.value_head, self.optimizer_state)
        return {}


def train_policy(
    turns: datasets.Dataset,
    policy_dir: str | Path,
    settings: PPOSettings,
    *,
    train_critic: bool,
    seed: int,
    report_progress: Callable[[float], None] | None = None,
    ranks: Ranks = SINGLE,
) -> TrainedPolicy | None:
    """ppo-update: load the policy to train (the one that generated `turns`, the compute-advantages
    rows, or with ppo.max_staleness a newer one) with its value head and AdamW state, optimise it
    on them, and return it ready to save.

    Full fine-tuning continues the previous iteration's AdamW (its state is saved beside the
    policy). With ppo.lora_rank > 0 fresh adapters are trained and merged afterwards, so the
    next policy is a plain checkpoint (and there is no optimiser to continue).

    With several `ranks` (under torchrun, see stages/ppo_update/worker.py) the policy is sharded with
    FSDP2 and the value head replicated; rank 0 gets the trained policy back whole, the other
    ranks None."""
    settings = training_memory(settings, policy_dir, settings.device)
    model, tokenizer = load_model(policy_dir, "float32", settings.device), load_tokenizer(str(policy_dir))
    value_head = None
    if train_critic:
        value_head = ValueHead.load(policy_dir, model.config.hidden_size).to(model.device)
    if settings.lora_rank > 0:  # the run config refuses LoRA with several processes
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules="all-linear")
        # The adapters' random init draws from torch's global generator: seeded here, and under the
        # lock, so that no other thread (a value head built beside it) draws in between.
        with TRANSFORMERS_GLOBALS, warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated alias `is_gradient_checkpointing`: its FutureWarning
            # at every update is peft's to fix, not the user's
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            torch.manual_seed(seed)
            model = get_peft_model(model, lora)
    trained: torch.nn.Module = model  # what optimise_policy optimises: the model, or its sharded Scorer
    if ranks.distributed:
        trained = Scorer(model)
        shard_model(trained)  # before the optimiser: sharding replaces the parameters
    optimizer, restored = None, 0
    if settings.lora_rank == 0:
        optimizer = build_optimizer(model, settings, value_head)
        restored = load_optimizer_state(optimizer, model, value_head, policy_dir)
    metrics = optimise_policy(
        trained,
        turns,
        settings=settings,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
        value_head=value_head,
        optimizer=optimizer,
        report_progress=report_progress,
        ranks=ranks,
    )
    if settings.lora_rank > 0:
        model = model.merge_and_unload()
    writer = ranks.rank == 0
    optimizer_state = optimizer_tensors(optimizer, model, value_head, keep=writer) if optimizer else None
    if optimizer is not None:
        optimizer.state.clear()  # its whole copy is in optimizer_state: free the shards before gathering the model
    if ranks.distributed:
        model = gather_model(trained, policy_dir, keep=writer)
    if not writer:
        return None
    return TrainedPolicy(model, tokenizer, value_head, optimizer_state, metrics, restored)


def gather_model(sharded: Scorer, policy_dir: str | Path, keep: bool) -> torch.nn.Module | None:
    """The trained weights of a sharded Scorer, whole, in a plain model on the CPU (a
    collective: every rank calls it; the ranks that do not write pass keep=False, get None)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors on rank 0 only
    state = get_model_state_dict(sharded, options=options)
    if not keep:
        return None
    plain = load_model(policy_dir, "float32", "cpu")
    plain.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    return plain
