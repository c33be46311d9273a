"""ppo-update: recompute logprobs under the current policy and optimise the clipped PPO
objective on assistant tokens only; write one metrics row per optimiser step.

Each rollout is trained as one sequence: its full token stream, with the loss on the tokens
the policy sampled (completion tokens) and nothing on prompts, observations or generation
prompts. `old_logprobs` are the generation-time logprobs stored with the rollouts, under
the same convention as here: log_softmax(logits / temperature).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from schemas.config import PPOConfig

# ---------------------------------------------------------------------------------------
# Pure functions: logprobs and the loss
# ---------------------------------------------------------------------------------------


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - log_norm
    with torch.no_grad():  # entropy is a diagnostic; no gradient through it
        probs = torch.softmax(logits, dim=-1)
        entropy = log_norm - (probs * logits).sum(-1)
    return logprobs, entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each target token from the hidden states that predict it.

    The vocabulary projection runs over chunks of tokens under activation checkpointing, so
    a full [tokens, vocab] fp32 tensor never exists for the whole batch, in the forward or
    the backward pass.
    """
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs_entropy, h, lm_head, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(h, lm_head, t, temperature)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate averaged over tokens (token-mean), with separate low/high
    clip ranges (clip-higher). Inputs are flat over the trained tokens."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "clip_fraction": (clipped > unclipped).float().mean(),
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),  # k3 estimator of KL(old || new)
            "ratio_mean": ratio.mean(),
            "ratio_max": ratio.max(),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------
# Batching rollouts into sequences
# ---------------------------------------------------------------------------------------


@dataclass
class Sequence:
    token_ids: list[int]
    target_positions: list[int]  # positions of the sampled tokens in token_ids
    old_logprobs: list[float]
    advantages: list[float]


def rollout_sequences(turns: datasets.Dataset) -> list[Sequence]:
    """One training sequence per rollout that did not fail, in rollout order."""
    columns = turns.select_columns(
        [
            "rollout_id",
            "turn",
            "failed",
            "context_token_ids",
            "completion_token_ids",
            "completion_logprobs",
            "observation_token_ids",
            "advantages",
        ]
    ).to_dict()
    order = sorted(range(len(columns["turn"])), key=lambda i: (columns["rollout_id"][i], columns["turn"][i]))
    sequences: dict[int, Sequence] = {}
    failed: set[int] = set()
    for i in order:
        rollout_id = columns["rollout_id"][i]
        if columns["failed"][i]:
            failed.add(rollout_id)
        seq = sequences.setdefault(rollout_id, Sequence([], [], [], []))
        seq.token_ids += columns["context_token_ids"][i]
        start = len(seq.token_ids)
        seq.token_ids += columns["completion_token_ids"][i]
        seq.target_positions += range(start, len(seq.token_ids))
        seq.old_logprobs += columns["completion_logprobs"][i]
        seq.advantages += columns["advantages"][i]
        seq.token_ids += columns["observation_token_ids"][i]
    return [seq for rollout_id, seq in sorted(sequences.items()) if rollout_id not in failed]


def _collate(batch: list[Sequence], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(s.token_ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    rows, positions = [], []
    for b, seq in enumerate(batch):
        input_ids[b, : len(seq.token_ids)] = torch.tensor(seq.token_ids)
        attention_mask[b, : len(seq.token_ids)] = 1
        rows += [b] * len(seq.target_positions)
        positions += seq.target_positions
    rows_t, positions_t = torch.tensor(rows), torch.tensor(positions)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "rows": rows_t.to(device),
        "positions": positions_t.to(device),
        "targets": input_ids[rows_t, positions_t].to(device),
        "old_logprobs": torch.tensor([lp for s in batch for lp in s.old_logprobs], device=device),
        "advantages": torch.tensor([a for s in batch for a in s.advantages], device=device),
    }


def policy_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (with gradient) and entropies of the batch's target tokens under `model`."""
    hidden = model.base_model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).last_hidden_state
    # The token at position p is predicted by the hidden state at p - 1.
    predicting = hidden[batch["rows"], batch["positions"] - 1]
    return token_logprobs(predicting, model.get_output_embeddings(), batch["targets"], temperature, chunk_tokens)


# ---------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------


def ppo_update(
    model: torch.nn.Module,
    turns: datasets.Dataset,
    *,
    config: PPOConfig,
    temperature: float,
    pad_token_id: int,
    seed: int,
) -> list[dict[str, float]]:
    """Optimise `model` in place on one iteration's rollouts; return per-step metrics."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    sequences = rollout_sequences(turns)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    shuffle = random.Random(seed)
    n_steps = config.epochs * -(-len(sequences) // config.minibatch_rollouts)
    metrics: list[dict[str, float]] = []
    progress = tqdm(total=n_steps, desc="ppo-update", unit="step", leave=False, disable=None)
    model.train()
    for epoch in range(config.epochs):
        order = list(range(len(sequences)))
        shuffle.shuffle(order)
        for start in range(0, len(order), config.minibatch_rollouts):
            batch_sequences = [sequences[i] for i in order[start : start + config.minibatch_rollouts]]
            batch = _collate(batch_sequences, pad_token_id, device)
            logprobs, entropy = policy_logprobs(model, batch, temperature, config.logprob_chunk_tokens)
            loss, stats = clipped_policy_loss(
                logprobs, batch["old_logprobs"], batch["advantages"], config.clip_low, config.clip_high
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            metrics.append(
                {
                    "epoch": epoch,
                    "step": len(metrics),
                    "rollouts": len(batch_sequences),
                    "tokens": int(logprobs.numel()),
                    "learning_rate": config.learning_rate,
                    "policy_loss": loss.item(),
                    "entropy": entropy.mean().item(),
                    "grad_norm": grad_norm.item(),
                    **{name: value.item() for name, value in stats.items()},
                }
            )
            progress.update()
    progress.close()
    model.eval()
    return metrics


def metrics_summary(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Means over the optimiser steps (for the manifest)."""
    if not metrics:
        return {}
    return {name: float(np.mean([m[name] for m in metrics])) for name in metrics[0] if name not in ("epoch", "step")}
