"""The policy as the stages use it: load it and score tokens with it.

  1. loading: the tokenizer (it must have a chat template), the model, its EOS tokens, the device,
     the value head;
  2. scoring: one sequence per rollout (its whole token stream), the logprobs, entropies and
     critic values of its completion tokens (the vocabulary projection chunked), KL estimators.

Saving a trained policy with its AdamW state is ppo-update's (stages/ppo_update/checkpoint.py).

generate-rollouts, compute-advantages (critic values, reference logprobs), ppo-update and the
audit (re-scoring) all score through score_rollouts / forward_targets, so they agree on
    logprob = log_softmax(logits / temperature)[token]
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import datasets
import torch
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from schemas.config import PPOConfig, SFTConfig
from schemas.token_stream import rollouts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model path that cannot be used as a policy, with the reason."""


# ---------------------------------------------------------------------------------------
# 1. Loading
# ---------------------------------------------------------------------------------------


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Any:
    """The policy's tokenizer; `chat_template` (the text of a Jinja template) replaces its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise ModelError(
            f"{model_dir}: the tokenizer has no chat template; multi-turn rollouts need one "
            "(set model.chat_template: hermes, the tool-calling template mtrl ships for ChatML models, or a file)"
        )
    if tokenizer.eos_token is None:
        raise ModelError(f"{model_dir}: the tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# transformers' from_pretrained changes process-wide state while it builds a model: the default
# dtype, torch.nn.init's functions (no-ops), PreTrainedModel.tie_weights (a no-op). A second thread
# loading at the same time built a model whose tied lm_head stayed on the meta device (measured).
# With ppo.max_staleness the flow prepares the next iteration's batch in a second thread: loads
# take this lock, and so do module initialisations (the value head, LoRA adapters) and the HF
# engine's forward passes, which create tensors under the default dtype.
TRANSFORMERS_GLOBALS = threading.RLock()


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "auto") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with TRANSFORMERS_GLOBALS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
    return model.to(pick_device(device)).eval()


# From this size on, training saves memory unless told otherwise (ppo and sft's null
# gradient_checkpointing, ppo's null max_tokens_per_micro_batch): a 135M model's ppo-update peaked
# at 11.7 GB with 16 padded rollouts a pass and no checkpointing; the 0.88M demo model needs none.
LARGE_MODEL_PARAMETERS = 50_000_000


def parameter_count(model_dir: str | Path) -> int:
    """The parameters of a saved model, read from its safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    count = 0
    for path in Path(model_dir).glob("model*.safetensors"):  # one file, or the shards of a large model
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():
                count += math.prod(weights.get_slice(name).get_shape())
    return count


def large_model(model_dir: str | Path) -> bool:
    """The memory rule of training (ppo-update and sft): does this saved model save memory by
    default (LARGE_MODEL_PARAMETERS)?"""
    return parameter_count(model_dir) >= LARGE_MODEL_PARAMETERS


Training = TypeVar("Training", PPOConfig, SFTConfig)


# For a large model on the CPU (large_model). Small, because a packed pass attends over its whole
# row under a block-diagonal mask: CPU attention builds scores quadratic in the row's length (a
# 135M model's update with 4096-token passes peaked at 5.6 GB, 4.2 GB above its start).
LARGE_MODEL_TOKENS_PER_MICRO_BATCH = 1024


def memory_settings(config: Training, large: bool, on_gpu: bool = False) -> Training:
    """The ppo or sft config with its null memory fields chosen by the model's size (large_model)
    and the device: activation checkpointing for a large model, and on the CPU packed
    micro-batches of a token budget; neither for a small one (where they only cost time). A GPU
    gets padded passes: there packing ran 2-18x slower than padding (SmolLM2-135M's shape in bf16
    on an H200: 2.4k-23k against 42.7k tokens/s). The same policy on the same device always gets
    the same choice (the stage's version hashes the device)."""
    chosen: dict[str, Any] = {}
    if config.gradient_checkpointing is None:
        chosen["gradient_checkpointing"] = large
    if config.max_tokens_per_micro_batch is None:
        chosen["max_tokens_per_micro_batch"] = LARGE_MODEL_TOKENS_PER_MICRO_BATCH if large and not on_gpu else 0
    return config.model_copy(update=chosen)


def training_memory(config: Training, policy_dir: str | Path, device: str) -> Training:
    """memory_settings for training this saved policy on this device (model.device)."""
    return memory_settings(config, large_model(policy_dir), on_gpu=pick_device(device).type == "cuda")


def micro_batches(sequences: list[RolloutSequence], rollouts: int, max_tokens: int) -> list[list[RolloutSequence]]:
    """Split sequences into forward/backward passes (ppo-update's rollouts, sft's demonstrations):
    `rollouts` at a time, or, with
    max_tokens > 0, first-fit-decreasing bins of at most max_tokens tokens (a longer rollout
    gets a bin of its own), which collate packs into one row: memory follows the token
    budget, not the longest rollout times the number of rollouts."""
    if max_tokens <= 0:
        return [sequences[i : i + rollouts] for i in range(0, len(sequences), rollouts)]
    bins: list[list[RolloutSequence]] = []
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


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Tokens that end an assistant turn: the tokenizer's EOS plus the model's generation EOS.
    `model` is the model or its GenerationConfig (an engine that does not load the model)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", model), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return sorted(i for i in ids if i is not None)


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
        with TRANSFORMERS_GLOBALS:  # torch.nn.init is a no-op while another thread loads a model
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


# ---------------------------------------------------------------------------------------
# 2. Scoring
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


@dataclass
class RolloutSequence:
    """One rollout as the model scores or trains on it: its whole token stream and, per sampled
    token, its position in the stream and the values the loss reads."""

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


def rollout_sequences(turns: datasets.Dataset, include_failed: bool = False) -> list[RolloutSequence]:
    """One sequence per rollout, in rollout order (failed rollouts left out): its whole token
    stream, with its completion tokens as targets."""
    optional = [name for name in OPTIONAL_COLUMNS if name in turns.column_names]
    columns = turns.select_columns(["completion_logprobs", *optional]).to_dict()
    sequences = []
    for rollout in rollouts(turns):
        if rollout.failed and not include_failed:
            continue
        seq = RolloutSequence(rows=rollout.rows, token_ids=rollout.token_ids)
        for row, (start, end) in zip(rollout.rows, rollout.completion_spans):
            seq.target_positions += range(start, end)
            seq.generation_logprobs += columns["completion_logprobs"][row]
            for name, target in (("advantages", seq.advantages), ("returns", seq.returns)):
                if name in columns:
                    target += columns[name][row]
            if columns.get("values") and columns["values"][row]:
                seq.old_values += columns["values"][row]
            if columns.get("ref_logprobs") and columns["ref_logprobs"][row]:
                seq.ref_logprobs += columns["ref_logprobs"][row]
        sequences.append(seq)
    return sequences


def collate(
    batch: list[RolloutSequence], pad_token_id: int, device: torch.device, packed: bool = False
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
