"""The policy as the stages use it: load it and score tokens with it.

  1. loading: the tokenizer (it must have a chat template), the model, its EOS tokens, the device,
     the value head;
  2. scoring: one sequence per rollout (its whole token stream), the logprobs, entropies and
     critic values of its completion tokens (the vocabulary projection chunked), KL estimators;
     a group's shared prompt computed once (collate's share_prefix);
  3. counting: which passes ran over how many tokens (the compute-advantages and ppo-update
     manifests' "passes").

Saving a trained policy with its AdamW state is ppo-update's (stages/ppo_update/checkpoint.py).

generate-rollouts, compute-advantages (critic values, reference logprobs), ppo-update and the
audit (re-scoring) all score through score_rollouts / forward_targets, so they agree on
    logprob = log_softmax(logits / temperature)[token]
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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


def micro_batches(
    sequences: list[RolloutSequence], rollouts: int, max_tokens: int, share_prefix: bool = False
) -> list[list[RolloutSequence]]:
    """Split sequences into forward/backward passes (ppo-update's rollouts, sft's demonstrations):
    `rollouts` at a time, or, with max_tokens > 0, first-fit-decreasing bins of at most max_tokens
    computed tokens (a longer rollout gets a bin of its own), which collate packs into one row:
    memory follows the token budget, not the longest rollout times the number of rollouts.
    With share_prefix, sequences with a common prefix are binned together and cost it once
    (computed_tokens); a unit over the budget is split."""
    if max_tokens <= 0:
        return [sequences[i : i + rollouts] for i in range(0, len(sequences), rollouts)]
    pieces: list[list[RolloutSequence]] = []
    for unit in prefix_units(sequences) if share_prefix else [[s] for s in sequences]:
        piece: list[RolloutSequence] = []
        for seq in unit:
            if piece and computed_tokens([*piece, seq]) > max_tokens:
                pieces.append(piece)
                piece = []
            piece.append(seq)
        pieces.append(piece)
    bins: list[list[RolloutSequence]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=computed_tokens, reverse=True):
        cost = computed_tokens(piece)
        fits = next((b for b, free in enumerate(room) if free >= cost), None)
        if fits is None:
            bins.append([])
            room.append(max_tokens)
            fits = len(bins) - 1
        bins[fits] += piece
        room[fits] -= cost
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


def common_prefix_length(sequences: list[RolloutSequence]) -> int:
    """How many leading tokens `sequences` can share in one pass: their common prefix, up to the
    token before the first predicted one. So every predicted token is predicted by a hidden state
    of its own sequence: one hidden state predicting several tokens sums their gradients in an
    order that varies from run to run with two threads (measured: the same update differed by
    1e-6 between runs)."""
    first = sequences[0].token_ids
    length = len(first)
    for seq in sequences:
        length = min(length, len(seq.token_ids), *(p - 1 for p in seq.target_positions[:1]))
        length = next((i for i in range(length) if seq.token_ids[i] != first[i]), length)
    return max(length, 0)


def computed_tokens(unit: list[RolloutSequence]) -> int:
    """Tokens a pass computes for sequences laid out as one unit: their common prefix once, then
    each one's remainder."""
    shared = common_prefix_length(unit)
    return shared + sum(len(seq.token_ids) - shared for seq in unit)


# The attention of a shared-prefix row runs over the whole row under a dense mask, masked pairs
# included: one row of many long remainders would cost more than the prefix it saves. A unit stays
# under this many tokens, or twice its batch's longest sequence (packed rows: the token budget).
SHARED_ROW_TOKENS = 2048


def prefix_units(sequences: list[RolloutSequence]) -> list[list[RolloutSequence]]:
    """The sequences in units that share a prefix (a group's prompt; with one system prompt and
    toolset, every rollout's first tokens). In token order, a sequence joins the unit before it
    when that computes no more tokens than starting a unit of its own (with k members sharing L
    tokens, a newcomer sharing L' <= L with them joins when k * L' >= (k - 1) * L) and the unit
    stays under SHARED_ROW_TOKENS or twice the longest sequence."""
    limit = max(SHARED_ROW_TOKENS, 2 * max((len(s.token_ids) for s in sequences), default=0))
    units: list[list[RolloutSequence]] = []
    shared = length = 0  # the last unit's common prefix and its members' tokens
    for seq in sorted(sequences, key=lambda s: s.token_ids):
        if units:  # in token order the unit's common prefix with seq is its last member's, at most
            joined = min(shared, common_prefix_length([units[-1][-1], seq]))
            saves = joined > 0 and len(units[-1]) * joined >= (len(units[-1]) - 1) * shared
            if saves and length + len(seq.token_ids) - len(units[-1]) * joined <= limit:  # computed_tokens
                units[-1].append(seq)
                shared, length = joined, length + len(seq.token_ids)
                continue
        units.append([seq])
        shared = length = len(seq.token_ids)
    return units


def collate(
    batch: list[RolloutSequence],
    pad_token_id: int,
    device: torch.device,
    packed: bool = False,
    share_prefix: bool = False,
) -> dict[str, torch.Tensor]:
    """Token ids plus flat per-target-token tensors, in `batch` order (and which sequence each is
    from): `targets` sits at (`rows`, `positions`) of input_ids and is predicted by the hidden
    state at (`rows`, `predictors`).

    Padded: one right-padded row per sequence, with an attention mask. Packed: all sequences in
    one row, no padding, position ids restarting at 0 for each; transformers then builds a
    block-diagonal causal mask from the position ids, so a sequence never attends to another one
    and its logprobs equal the padded ones.

    share_prefix: sequences that start alike (prefix_units) form one unit, their common prefix
    once and then each one's remainder, with the position ids it has in its own sequence, under a
    4D mask where a remainder sees the prefix and itself only: the unshared logprobs (and
    gradients) from fewer computed tokens. A unit per row when padded, all in one row when packed."""
    units = prefix_units(batch) if share_prefix else [[seq] for seq in batch]
    # Nothing shared: the plain layout, whose mask lets attention take its fastest kernel (on an
    # H100 a pass under the 4D mask ran 1.3x slower on the same tokens).
    share_prefix = any(len(unit) > 1 for unit in units)
    # Per row: token ids, position ids, and per token its unit (-1: padding) and branch (0: the
    # shared prefix, i: the remainder of the unit's i-th member); per sequence, where each of its
    # stream positions sits in its row.
    tokens: list[list[int]] = []
    position_ids: list[list[int]] = []
    unit_of: list[list[int]] = []
    branch_of: list[list[int]] = []
    placed: dict[int, tuple[int, Callable[[int], int]]] = {}
    for u, unit in enumerate(units):
        if not tokens or not packed:  # a new row
            for per_row in (tokens, position_ids, unit_of, branch_of):
                per_row.append([])
        shared = common_prefix_length(unit)
        start = len(tokens[-1])
        tokens[-1] += unit[0].token_ids[:shared]
        position_ids[-1] += range(shared)
        unit_of[-1] += [u] * shared
        branch_of[-1] += [0] * shared
        for branch, seq in enumerate(unit, start=1):
            rest = len(tokens[-1]) - shared  # where position p >= shared of this member sits

            def flat(p: int, start: int = start, rest: int = rest, shared: int = shared) -> int:
                return start + p if p < shared else rest + p

            placed[id(seq)] = (len(tokens) - 1, flat)
            tokens[-1] += seq.token_ids[shared:]
            position_ids[-1] += range(shared, len(seq.token_ids))
            unit_of[-1] += [u] * (len(seq.token_ids) - shared)
            branch_of[-1] += [branch] * (len(seq.token_ids) - shared)
    width = max(len(row) for row in tokens)

    def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.long)

    input_ids = padded(tokens, pad_token_id)
    sequence_index, rows, positions, predictors = [], [], [], []
    for b, seq in enumerate(batch):
        row, flat = placed[id(seq)]
        sequence_index += [b] * len(seq.target_positions)
        rows += [row] * len(seq.target_positions)
        positions += [flat(p) for p in seq.target_positions]
        predictors += [flat(p - 1) for p in seq.target_positions]  # position p is predicted at p - 1
    rows_t, positions_t = torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)

    def flat_values(name: str) -> torch.Tensor:
        return torch.tensor([x for s in batch for x in getattr(s, name)], dtype=torch.float32, device=device)

    out = {
        "input_ids": input_ids.to(device),
        "sequence_index": torch.tensor(sequence_index, dtype=torch.long, device=device),
        "rows": rows_t.to(device),
        "positions": positions_t.to(device),
        "predictors": torch.tensor(predictors, dtype=torch.long, device=device),
        "targets": input_ids[rows_t, positions_t].to(device),
        "tokens": torch.tensor(sum(len(row) for row in tokens)),  # computed, padding left out
    }
    if share_prefix:
        unit_t, branch_t = padded(unit_of, -1), padded(branch_of, 0)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_unit = unit_t[:, :, None] == unit_t[:, None, :]
        sees_branch = (branch_t[:, None, :] == 0) | (branch_t[:, :, None] == branch_t[:, None, :])
        out["attention_mask"] = (causal & same_unit & sees_branch)[:, None].to(device)  # [rows, 1, query, key]
        out["position_ids"] = padded(position_ids, 0).to(device)
    elif packed:
        out["position_ids"] = padded(position_ids, 0).to(device)
    else:
        out["attention_mask"] = (padded(unit_of, -1) >= 0).long().to(device)
    for name in ("generation_logprobs", "old_logprobs", "advantages", "returns", "old_values", "ref_logprobs"):
        if all(len(getattr(s, name)) == len(s.target_positions) for s in batch):
            out[name] = flat_values(name)
    return out


def shares_prefix(model: torch.nn.Module) -> bool:
    """Can this model take collate's shared-prefix mask? Its attention must take a custom mask
    (sdpa, eager) and attend over the whole context in every layer: a custom mask replaces a
    sliding window's, so a model with sliding-window layers is scored unshared."""
    config = model.config
    full = all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return config._attn_implementation in ("sdpa", "eager") and full and not windowed


def attention_mask_for(model: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """collate's boolean 4D mask (True: attend) as the model's attention takes it: sdpa as it is,
    eager as an additive mask."""
    if model.config._attn_implementation != "eager":
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


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


# ---------------------------------------------------------------------------------------
# 3. Counting passes
# ---------------------------------------------------------------------------------------

PassCounts = dict[str, dict[str, int]]
_PASS_COUNTS: ContextVar[PassCounts | None] = ContextVar("mtrl_pass_counts", default=None)


@contextmanager
def counting_passes() -> Iterator[PassCounts]:
    """Count the passes over the policy that run in this context (this thread), by kind:
    {kind: {"passes", "tokens" (computed: a shared prefix once, no padding), "padded_tokens" (the
    rows' whole width), "targets" (the predicted tokens)}}."""
    counts: PassCounts = {}
    token = _PASS_COUNTS.set(counts)
    try:
        yield counts
    finally:
        _PASS_COUNTS.reset(token)


def count_pass(kind: str, batch: dict[str, torch.Tensor]) -> None:
    """One pass of `kind` over a collated batch, where counting_passes counts."""
    counts = _PASS_COUNTS.get()
    if counts is not None:
        add_counts(
            counts,
            {
                kind: {
                    "passes": 1,
                    "tokens": int(batch["tokens"]),
                    "padded_tokens": batch["input_ids"].numel(),
                    "targets": len(batch["targets"]),
                }
            },
        )


def add_counts(into: PassCounts, counts: PassCounts) -> PassCounts:
    """Add `counts` (another rank's, another stage's) into `into`; returns it."""
    for kind, numbers in counts.items():
        entry = into.setdefault(kind, dict.fromkeys(numbers, 0))
        for name, value in numbers.items():
            entry[name] += value
    return into
