"""ppo-update: recompute logprobs under the current policy and optimise the clipped PPO
objective (Schulman et al. 2017, arXiv:1707.06347) on the tokens the policy sampled; write one
metrics row per optimiser step.

Read top to bottom:
  1. pure functions: logprobs over a chunked vocabulary, the policy loss (clip-higher, dual
     clip), KL estimators, the value loss, loss aggregation modes;
  2. batching: one training sequence per rollout (its whole token stream; the loss covers
     completion tokens only, never prompts, observations or generation prompts), padded
     rows or packed into a token budget;
  3. the optimisation loop: epochs x shuffled mini-batches x gradient-accumulated micro-batches.

Convention: logprob = log_softmax(logits / temperature)[token], as at generation time.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from schemas.config import PPOConfig

# ---------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------


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
    config: PPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-token total loss and its terms, before aggregation:

        total = w * clipped_surrogate - entropy_coef * H (+ kl_coef * KL) (+ value_coef * value loss)

    with w the truncated IS weight. KL enters when config.kl_in == "loss" and kl_coef > 0;
    the value loss when `values` (the critic's) are given.
    Returns (total, {term name: per-token value}, whether the ratio clip was active, w)."""
    surrogate, was_clipped = policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], config.clip_low, config.clip_high, config.clip_ratio_c
    )
    is_weight = truncated_is_weight(batch["old_logprobs"], batch["generation_logprobs"], config.tis_cap)
    weighted = surrogate * is_weight
    total = weighted - config.entropy_coef * entropy
    terms = {"policy_loss": weighted, "entropy": entropy}
    if config.kl_coef > 0 and config.kl_in == "loss":
        terms["kl"] = kl_estimate(logprobs, batch["ref_logprobs"], config.kl_estimator)
        total = total + config.kl_coef * terms["kl"]
    if values is not None:
        terms["value_loss"] = value_loss(values, batch["old_values"], batch["returns"], config.value_clip)
        total = total + config.value_coef * terms["value_loss"]
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
# 2. Batching rollouts into sequences
# ---------------------------------------------------------------------------------------


@dataclass
class Sequence:
    rows: list[int] = field(default_factory=list)  # dataset rows of its turns, in turn order
    token_ids: list[int] = field(default_factory=list)
    target_positions: list[int] = field(default_factory=list)  # sampled tokens in token_ids
    generation_logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    old_values: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)  # filled before training


OPTIONAL_COLUMNS = ("advantages", "returns", "values", "ref_logprobs")


def rollout_sequences(turns: datasets.Dataset, include_failed: bool = False) -> list[Sequence]:
    """One training sequence per rollout, in rollout order (failed rollouts left out)."""
    names = ["rollout_id", "turn", "failed", "context_token_ids", "completion_token_ids", "completion_logprobs"]
    columns = turns.select_columns(names + [c for c in OPTIONAL_COLUMNS if c in turns.column_names]).to_dict()
    order = sorted(range(len(columns["turn"])), key=lambda i: (columns["rollout_id"][i], columns["turn"][i]))
    observation = turns.select_columns(["observation_token_ids"])["observation_token_ids"]
    sequences: dict[int, Sequence] = {}
    failed: set[int] = set()
    for i in order:
        rollout_id = columns["rollout_id"][i]
        if columns["failed"][i]:
            failed.add(rollout_id)
        seq = sequences.setdefault(rollout_id, Sequence())
        seq.rows.append(i)
        seq.token_ids += columns["context_token_ids"][i]
        start = len(seq.token_ids)
        seq.token_ids += columns["completion_token_ids"][i]
        seq.target_positions += range(start, len(seq.token_ids))
        seq.generation_logprobs += columns["completion_logprobs"][i]
        for name, target in (("advantages", seq.advantages), ("returns", seq.returns)):
            if name in columns:
                target += columns[name][i]
        if columns.get("values") and columns["values"][i]:
            seq.old_values += columns["values"][i]
        if columns.get("ref_logprobs") and columns["ref_logprobs"][i]:
            seq.ref_logprobs += columns["ref_logprobs"][i]
        seq.token_ids += observation[i]
    return [seq for rid, seq in sorted(sequences.items()) if include_failed or rid not in failed]


def micro_batches(sequences: list[Sequence], rollouts: int, max_tokens: int) -> list[list[Sequence]]:
    """Split sequences into forward/backward passes: `rollouts` at a time, or, with
    max_tokens > 0, first-fit-decreasing bins of at most max_tokens tokens (a longer rollout
    gets a bin of its own), which collate packs into one row: memory follows the token
    budget, not the longest rollout times the number of rollouts."""
    if max_tokens <= 0:
        return [sequences[i : i + rollouts] for i in range(0, len(sequences), rollouts)]
    bins: list[list[Sequence]] = []
    room: list[int] = []
    for seq in sorted(sequences, key=lambda s: len(s.token_ids), reverse=True):
        fits = next((b for b, free in enumerate(room) if free >= len(seq.token_ids)), None)
        if fits is None:
            bins.append([])
            room.append(max_tokens)
            fits = len(bins) - 1
        bins[fits].append(seq)
        room[fits] -= len(seq.token_ids)
    return bins


def collate(
    batch: list[Sequence], pad_token_id: int, device: torch.device, packed: bool = False
) -> dict[str, torch.Tensor]:
    """Token ids plus flat per-target-token tensors (and which sequence each is from).

    Padded: one right-padded row per sequence, with an attention mask. Packed: all sequences
    in one row, no padding, position ids restarting at 0 for each; transformers then builds
    a block-diagonal causal mask from the position ids, so a sequence never attends to
    another one and its logprobs equal the padded ones."""
    starts = [0] * len(batch)
    if packed:
        for b in range(1, len(batch)):
            starts[b] = starts[b - 1] + len(batch[b - 1].token_ids)
        input_ids = torch.tensor([[t for s in batch for t in s.token_ids]], dtype=torch.long)
        position_ids = torch.tensor([[p for s in batch for p in range(len(s.token_ids))]], dtype=torch.long)
    else:
        width = max(len(s.token_ids) for s in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for b, seq in enumerate(batch):
            input_ids[b, : len(seq.token_ids)] = torch.tensor(seq.token_ids)
            attention_mask[b, : len(seq.token_ids)] = 1
    sequence_index, rows, positions = [], [], []
    for b, seq in enumerate(batch):
        sequence_index += [b] * len(seq.target_positions)
        rows += [0 if packed else b] * len(seq.target_positions)
        positions += [starts[b] + p for p in seq.target_positions]
    rows_t, positions_t = torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)

    def flat(name: str) -> torch.Tensor:
        return torch.tensor([x for s in batch for x in getattr(s, name)], dtype=torch.float32, device=device)

    out = {
        "input_ids": input_ids.to(device),
        "sequence_index": torch.tensor(sequence_index, dtype=torch.long, device=device),
        "rows": rows_t.to(device),
        "positions": positions_t.to(device),
        "targets": input_ids[rows_t, positions_t].to(device),
    }
    if packed:
        out["position_ids"] = position_ids.to(device)
    else:
        out["attention_mask"] = attention_mask.to(device)
    for name in ("generation_logprobs", "old_logprobs", "advantages", "returns", "old_values", "ref_logprobs"):
        if all(len(getattr(s, name)) == len(s.target_positions) for s in batch):
            out[name] = flat(name)
    return out


class ValueHead(torch.nn.Module):
    """V(s_t) from the policy's last hidden state: one linear layer on the policy's features.

    The features are detached (see forward_targets): the value loss trains the head only,
    never the policy. With the gradient shared, the critic's early, large value loss
    (V = 0 against returns near 1) outweighed the policy gradient in the backbone and the
    policy collapsed within five iterations on guess-number; TRL, verl and OpenRLHF keep
    critic gradients out of the policy too (with a separate critic model)."""

    FILE = "value_head.safetensors"

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.float())[..., 0]

    @classmethod
    def load(cls, policy_dir: str | Path, hidden_size: int) -> ValueHead:
        """The value head saved beside a policy, or a zero-initialised one (V = 0)."""
        head = cls(hidden_size)
        path = Path(policy_dir) / cls.FILE
        if path.is_file():
            head.load_state_dict(load_file(path))
        return head

    def save(self, policy_dir: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, Path(policy_dir) / self.FILE)


def forward_targets(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    chunk_tokens: int,
    value_head: ValueHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logprobs, entropies and (with a value head) values of the batch's target tokens."""
    hidden = model.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
    ).last_hidden_state
    # The token at position p is predicted by (and its state is) the hidden state at p - 1.
    predicting = hidden[batch["rows"], batch["positions"] - 1]
    logprobs, entropy = token_logprobs(
        predicting, model.get_output_embeddings(), batch["targets"], temperature, chunk_tokens
    )
    values = value_head(predicting.detach()) if value_head is not None else None  # the critic never moves the policy
    return logprobs, entropy, values


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
) -> tuple[list[list[float]], list[list[float]]]:
    """Per dataset row: logprobs of its completion tokens under `model` (and values, with a
    value head). Used for reference-model logprobs and critic values."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logprobs_of: list[list[float]] = [[] for _ in range(len(turns))]
    values_of: list[list[float]] = [[] for _ in range(len(turns))]
    lengths = [len(t) for t in turns["completion_token_ids"]]
    sequences = rollout_sequences(turns, include_failed=True)
    for start in range(0, len(sequences), batch_rollouts):
        chunk = sequences[start : start + batch_rollouts]
        logprobs, _, values = forward_targets(
            model, collate(chunk, pad_token_id, device), temperature, chunk_tokens, value_head
        )
        offset = 0
        for seq in chunk:
            for row in seq.rows:
                logprobs_of[row] = logprobs[offset : offset + lengths[row]].tolist()
                if values is not None:
                    values_of[row] = values[offset : offset + lengths[row]].tolist()
                offset += lengths[row]
    model.train(was_training)
    return logprobs_of, values_of


# ---------------------------------------------------------------------------------------
# 3. The optimisation loop
# ---------------------------------------------------------------------------------------


OPTIMIZER_FILE = "optimizer.safetensors"


def build_optimizer(
    model: torch.nn.Module, config: PPOConfig, value_head: ValueHead | None = None
) -> torch.optim.AdamW:
    """AdamW over the policy's trainable parameters (group 0) and the critic's (group 1)."""
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters())})
    return torch.optim.AdamW(groups, lr=config.learning_rate, weight_decay=config.weight_decay)


def _named_trainable(model: torch.nn.Module, value_head: ValueHead | None) -> dict[str, torch.nn.Parameter]:
    named = {f"policy.{n}": p for n, p in model.named_parameters() if p.requires_grad}
    if value_head is not None:
        named |= {f"critic.{n}": p for n, p in value_head.named_parameters()}
    return named


def save_optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, value_head: ValueHead | None, directory: str | Path
) -> None:
    """Adam's moments and step count per named parameter, as safetensors beside the policy
    (never pickle), so the next iteration's update continues the same optimiser."""
    tensors = {}
    for name, param in _named_trainable(model, value_head).items():
        for key, value in optimizer.state.get(param, {}).items():  # step, exp_avg, exp_avg_sq
            tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
    save_file(tensors, Path(directory) / OPTIMIZER_FILE)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, value_head: ValueHead | None, directory: str | Path
) -> int:
    """Restore what save_optimizer_state wrote beside a policy; returns how many parameters
    got their state back (0 without a file: a fresh optimiser). A parameter without saved
    state (a critic added later) starts fresh; a shape that does not match is an error."""
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        return 0
    saved: dict[str, dict[str, torch.Tensor]] = {}  # parameter name -> {step, exp_avg, exp_avg_sq}
    for key, value in load_file(path).items():
        name, _, field = key.rpartition("/")
        saved.setdefault(name, {})[field] = value
    restored = 0
    for name, param in _named_trainable(model, value_head).items():
        state = saved.get(name)
        if not state:
            continue
        for key, value in state.items():
            if key != "step" and value.shape != param.shape:
                raise ValueError(
                    f"{path}: state '{name}/{key}' has shape {tuple(value.shape)}, not {tuple(param.shape)}"
                )
        # Adam keeps `step` on the CPU (non-capturable); the moments live with the parameter.
        optimizer.state[param] = {k: v if k == "step" else v.to(param.device, param.dtype) for k, v in state.items()}
        restored += 1
    return restored


def _autocast(device: torch.device, mode: str):
    use_bf16 = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def ppo_update(
    model: torch.nn.Module,
    turns: datasets.Dataset,
    *,
    config: PPOConfig,
    temperature: float,
    pad_token_id: int,
    seed: int,
    value_head: ValueHead | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[dict[str, float]]:
    """Optimise `model` (and `value_head`, when given) in place on one iteration's rollouts.
    `optimizer` (from build_optimizer, with the previous iteration's state loaded) continues
    one AdamW across iterations, as TRL and verl do; without it a fresh one is built, whose
    first steps move every parameter by about the learning rate (Adam's bias correction), noise
    included. Returns one metrics dict per optimiser step."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    sequences = [s for s in rollout_sequences(turns) if s.target_positions]
    train_value = value_head is not None and all(len(s.old_values) == len(s.target_positions) for s in sequences)
    use_kl_loss = config.kl_coef > 0 and config.kl_in == "loss"
    if use_kl_loss and not all(len(s.ref_logprobs) == len(s.target_positions) for s in sequences):
        raise ValueError("kl_in='loss' needs ref_logprobs in the compute-advantages dataset")

    # Old logprobs: the policy before this update, recomputed by the training forward pass;
    # generation logprobs differ once kernels or precision differ, which TIS corrects for.
    packed = config.max_tokens_per_micro_batch > 0
    for chunk in micro_batches(sequences, config.micro_batch_rollouts, config.max_tokens_per_micro_batch):
        if config.recompute_old_logprobs:
            with torch.no_grad(), _autocast(device, config.autocast):
                logprobs, _, _ = forward_targets(
                    model, collate(chunk, pad_token_id, device, packed), temperature, config.logprob_chunk_tokens
                )
            offset = 0
            for seq in chunk:
                seq.old_logprobs = logprobs[offset : offset + len(seq.target_positions)].tolist()
                offset += len(seq.target_positions)
        else:
            for seq in chunk:
                seq.old_logprobs = list(seq.generation_logprobs)

    optimizer = optimizer or build_optimizer(model, config, value_head)
    parameters = optimizer.param_groups[0]["params"]
    critic_parameters = optimizer.param_groups[1]["params"] if train_value else []
    shuffle = random.Random(seed)
    n_steps = config.epochs * -(-len(sequences) // config.minibatch_rollouts)
    metrics: list[dict[str, float]] = []
    progress = tqdm(total=n_steps, desc="ppo-update", unit="step", leave=False, disable=None)
    # Recompute each layer's activations in backward: less memory, about 1/3 more compute.
    # (gradient_checkpointing_* exist in every transformers 5.x; 5.23 renames them activation_*.)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for epoch in range(config.epochs):
        order = list(range(len(sequences)))
        shuffle.shuffle(order)
        for start in range(0, len(order), config.minibatch_rollouts):
            minibatch = [sequences[i] for i in order[start : start + config.minibatch_rollouts]]
            minibatch_tokens = sum(len(s.target_positions) for s in minibatch)
            sums: dict[str, float] = {}
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(minibatch, config.micro_batch_rollouts, config.max_tokens_per_micro_batch):
                batch = collate(micro, pad_token_id, device, packed)
                with _autocast(device, config.autocast):
                    logprobs, entropy, values = forward_targets(
                        model, batch, temperature, config.logprob_chunk_tokens, value_head if train_value else None
                    )
                total, terms, was_clipped, is_weight = token_loss(batch, logprobs, entropy, values, config)
                shares = {"loss": total, **terms}
                args = (
                    batch["sequence_index"],
                    config.loss_aggregation,
                    minibatch_tokens,
                    len(minibatch),
                    config.loss_norm_tokens,
                )
                objective = aggregate(total, *args)
                objective.backward()
                with torch.no_grad():
                    log_ratio = logprobs - batch["old_logprobs"]
                    diagnostics = {
                        **{name: aggregate(value.detach(), *args) for name, value in shares.items()},
                        "clip_fraction": was_clipped.float().sum() / minibatch_tokens,
                        "approx_kl": ((torch.exp(log_ratio) - 1.0) - log_ratio).sum() / minibatch_tokens,
                        "ratio_mean": torch.exp(log_ratio).sum() / minibatch_tokens,
                        "is_weight_mean": is_weight.sum() / minibatch_tokens,
                        "logprob_mismatch": (batch["old_logprobs"] - batch["generation_logprobs"]).abs().sum()
                        / minibatch_tokens,
                    }
                for name, value in diagnostics.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                sums["ratio_max"] = max(sums.get("ratio_max", 0.0), float(torch.exp(log_ratio).max()))
                sums["is_weight_max"] = max(sums.get("is_weight_max", 0.0), float(is_weight.max()))
            # Clipped apart: the critic's gradient must not shrink the policy's step.
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)
            if critic_parameters:
                sums["value_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(critic_parameters, config.max_grad_norm))
            optimizer.step()
            metrics.append(
                {
                    "epoch": epoch,
                    "step": len(metrics),
                    "rollouts": len(minibatch),
                    "tokens": minibatch_tokens,
                    "learning_rate": config.learning_rate,
                    "grad_norm": float(grad_norm),
                    **sums,
                }
            )
            progress.update()
    progress.close()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model.eval()
    return metrics


def metrics_summary(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the optimiser steps (for the manifest)."""
    if not metrics:
        return {}
    names = [name for name in metrics[0] if name not in ("epoch", "step")]
    return {name: float(np.mean([m.get(name, np.nan) for m in metrics])) for name in names}
