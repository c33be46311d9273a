"""Scoring tokens with the policy: the logprobs, entropies and critic values of a batch's target
tokens (the vocabulary projection chunked), whole datasets of turns, KL estimators.

generate-rollouts' engines, compute-advantages (critic values, reference logprobs), ppo-update and
the audit (re-scoring) all agree on
    logprob = log_softmax(logits / temperature)[token]
"""

from __future__ import annotations

import datasets
import torch
from torch.utils.checkpoint import checkpoint

from runtime.passes import count_pass
from stages.policy.batching import attention_mask_for, collate, rollout_sequences, shares_prefix
from stages.policy.loading import ValueHead


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - log_norm
    entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each target token from the hidden states that predict it.

    The vocabulary projection runs over chunks of tokens under activation checkpointing, so
    a full [tokens, vocab] fp32 tensor never exists for the whole batch, forward or backward.
    """
    logprobs, entropies = [hidden.new_zeros(0, dtype=torch.float32)], [hidden.new_zeros(0, dtype=torch.float32)]
    for start in range(0, hidden.shape[0], chunk_tokens):  # none: rollouts cut before their first token
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs_entropy, h, lm_head, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(h, lm_head, t, temperature)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def forward_targets(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    chunk_tokens: int,
    value_head: ValueHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logprobs, entropies and (with a value head) values of the batch's target tokens."""
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() == 4:  # collate's shared-prefix mask, boolean
        attention_mask = attention_mask_for(model, attention_mask)
    hidden = model.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=attention_mask,
        position_ids=batch.get("position_ids"),
        use_cache=False,
    ).last_hidden_state
    # The token at position p is predicted by (and its state is) the hidden state at p - 1.
    predicting = hidden[batch["rows"], batch["predictors"]]
    logprobs, entropy = token_logprobs(
        predicting, model.get_output_embeddings(), batch["targets"], temperature, chunk_tokens
    )
    values = value_head(predicting.detach()) if value_head is not None else None  # the critic never moves the policy
    return logprobs, entropy, values


class Scorer(torch.nn.Module):
    """forward_targets as one module call. Under FSDP2 (stages/sharding.py) this is the root
    unit: its forward gathers the parameters outside the decoder layers (embeddings, final
    norm, output projection), which forward_targets reaches without calling the model."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float,
        chunk_tokens: int,
        value_head: ValueHead | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return forward_targets(self.model, batch, temperature, chunk_tokens, value_head)


@torch.no_grad()
def score_rollouts(
    model: torch.nn.Module,
    turns: datasets.Dataset,
    *,
    temperature: float,
    pad_token_id: int,
    chunk_tokens: int,
    batch_rollouts: int,
    value_head: ValueHead | None = None,
    share_prefix: bool = False,
    kind: str = "scoring",
) -> tuple[list[list[float]], list[list[float]]]:
    """Per dataset row: logprobs of its completion tokens under `model` (and values, with a
    value head). Used for reference-model logprobs and critic values; `share_prefix` computes the
    common prefix of a chunk's rollouts once where the model allows (shares_prefix). Its passes
    are counted as `kind`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logprobs_of: list[list[float]] = [[] for _ in range(len(turns))]
    values_of: list[list[float]] = [[] for _ in range(len(turns))]
    lengths = [len(t) for t in turns["completion_token_ids"]]
    sequences = rollout_sequences(turns, include_failed=True)
    share_prefix = share_prefix and shares_prefix(model)
    for start in range(0, len(sequences), batch_rollouts):
        chunk = sequences[start : start + batch_rollouts]
        batch = collate(chunk, pad_token_id, device, share_prefix=share_prefix)
        count_pass(kind, batch)
        logprobs, _, values = forward_targets(model, batch, temperature, chunk_tokens, value_head)
        offset = 0
        for seq in chunk:
            for row in seq.rows:
                logprobs_of[row] = logprobs[offset : offset + lengths[row]].tolist()
                if values is not None:
                    values_of[row] = values[offset : offset + lengths[row]].tolist()
                offset += lengths[row]
    model.train(was_training)
    return logprobs_of, values_of


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs:
    k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r, with r = pi / pi_ref: the estimators
    of John Schulman's blog post "Approximating KL Divergence" (2020, no arXiv id,
    http://joschu.net/blog/kl-approx.html)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":  # low variance, always >= 0 (Schulman); clamped as in verl
        return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator '{estimator}'; valid: k1, k2, k3")
