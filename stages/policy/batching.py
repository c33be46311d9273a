"""Laying rollouts out for a pass over the policy: one sequence per rollout (its whole token stream,
its completion tokens the targets), micro-batches of a rollout count or a token budget, padded or
packed rows, a group's shared prompt computed once (collate's share_prefix), and the memory rule
that picks the layout of training passes by the model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import datasets
import torch
from pydantic import BaseModel

from schemas.token_stream import rollouts
from stages.policy.loading import parameter_count, pick_device


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
    stream, with its completion tokens as targets; a rollout of several segments (an agent that
    edited its history) gives one sequence per segment, each the tokens the model saw."""
    optional = [name for name in OPTIONAL_COLUMNS if name in turns.column_names]
    columns = turns.select_columns(["completion_logprobs", *optional]).to_dict()
    sequences = []
    for rollout in rollouts(turns):
        if rollout.failed and not include_failed:
            continue
        for positions, (first, last) in rollout.segment_spans():
            rows = [rollout.rows[position] for position in positions]
            seq = RolloutSequence(rows=rows, token_ids=rollout.token_ids[first:last])
            for position, row in zip(positions, rows):
                start, end = rollout.completion_spans[position]
                seq.target_positions += range(start - first, end - first)
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


# From this size on, training saves memory unless told otherwise (ppo and sft's null
# gradient_checkpointing, ppo's null max_tokens_per_micro_batch): a 135M model's ppo-update peaked
# at 11.7 GB with 16 padded rollouts a pass and no checkpointing; the 0.88M demo model needs none.
LARGE_MODEL_PARAMETERS = 50_000_000


def large_model(model_dir: str | Path) -> bool:
    """The memory rule of training (ppo-update and sft): does this saved model save memory by
    default (LARGE_MODEL_PARAMETERS)?"""
    return parameter_count(model_dir) >= LARGE_MODEL_PARAMETERS


# ppo-update's or sft's settings: both have gradient_checkpointing and max_tokens_per_micro_batch
Training = TypeVar("Training", bound=BaseModel)


# For a large model on the CPU (large_model). Small, because a packed pass attends over its whole
# row under a block-diagonal mask: CPU attention builds scores quadratic in the row's length (a
# 135M model's update with 4096-token passes peaked at 5.6 GB, 4.2 GB above its start).
LARGE_MODEL_TOKENS_PER_MICRO_BATCH = 1024


def memory_settings(config: Training, large: bool, on_gpu: bool = False) -> Training:
    """The ppo-update or sft settings with their null memory fields chosen by the model's size (large_model)
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
    """memory_settings for training this saved policy on this device."""
    return memory_settings(config, large_model(policy_dir), on_gpu=pick_device(device).type == "cuda")
