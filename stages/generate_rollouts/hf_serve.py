"""The HF engine serving agents' calls as they come (HFEngine.serve): continuous batching with
batch-invariant numbers.

Agents call when their own tools are done, so calls arrive at any moment. A call joins the batch at
the next decode step (its new tokens prefilled after its rollout's kept row) and leaves it when it
ends, its completion given back at once: no call waits for another's longest completion, no
lock-step turns. Each rollout's row is kept when its call ends, so its next call prefills only the
tokens the agent added.

Which calls share a forward pass is timing, so a row's numbers must not depend on it: then a
re-run (a resumed one) samples the same bytes whatever batches its calls met. Two things made a
row's numbers depend on its batch here (measured, torch 2.13 on CPU): attention over padded keys
(the reductions run over the padding, shifted by it) and CPU GEMM kernels, which compute a row
differently below MIN_GEMM_ROWS rows (and identically from there on). So, while serving:

- the cache holds each row's tokens at columns 0 .. length - 1 (left-aligned, RowCache), and
  attention is computed in plain matmuls over that layout (row_attention): a row's reductions run
  over its own tokens from column 0, then over exact zeros, whatever the batch's width;
- every linear layer runs on at least MIN_GEMM_ROWS rows (zero rows added, then dropped), and a
  prefill block is at least two tokens wide, so attention's matmuls see at least four rows too.

Sampling is seeded per call (sampling.draw), so the same call gives the same tokens too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from stages.generate_rollouts.engine import Completion, Request, Sampling
from stages.generate_rollouts.sampling import draw, finish_reason
from stages.policy.loading import TRANSFORMERS_GLOBALS

ROW_ATTENTION = "mtrl_rows"  # the attention implementation's name while serving
MIN_GEMM_ROWS = 4
GROW = 16  # columns added to the cache when a row needs more (fewer copies; attention runs over them too)
# The cache's width is a multiple of COLUMNS: a decode step's softmax and matmuls over the columns then give a
# row the same bits whatever the width (measured: any multiple of 8 here; a width with a ragged tail did not).
COLUMNS = 16

# A rollout's row after its last call: the tokens it holds, and every layer's (keys, values) of them.
Kept = tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Layout:
    """What row_attention needs to know of RowCache's rows, given to the model as its prepared mask: how
    many tokens each row holds once the block is added, how many of the block's last columns are its
    own, and for a decode step the additive mask [rows, 1, 1, cache columns] (0 on a row's tokens)."""

    lengths: list[int]
    own: list[int]
    decode_mask: torch.Tensor | None


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Layout,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over RowCache's layout. The query heads that share a KV head are stacked as rows of one
    matmul (no copy of the keys): [B, H, Q, D] -> [B, KV, H / KV * Q, D]. A decode step (one query per
    row) runs batched over every cache column: its matmuls give a row the same bits whatever the width
    (the columns past a row's tokens get weight 0). A prefill block runs row by row over exactly the
    row's tokens and queries: there the matmuls' bits depended on the width (measured)."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    query = query * (scaling if scaling is not None else dim**-0.5)

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, _, count, _ = query.shape
        stacked = query.reshape(rows, kv_heads, groups * count, dim)
        scores = torch.matmul(stacked, key.transpose(-1, -2)).view(rows, kv_heads, groups, count, -1)
        weights = (scores + mask).softmax(-1).view(rows, kv_heads, groups * count, -1)
        return torch.matmul(weights, value).reshape(rows, heads, count, dim)

    if attention_mask.decode_mask is not None:
        out = attend(query, key, value, attention_mask.decode_mask[:, :, None])
    else:
        out = query.new_zeros(query.shape)  # a padding query's output is never read
        for row, (length, own) in enumerate(zip(attention_mask.lengths, attention_mask.own)):
            causal = torch.ones((own, length), dtype=torch.bool, device=query.device).tril(length - own)
            mask = torch.zeros(causal.shape, device=query.device).masked_fill(~causal, float("-inf"))
            own_keys = key[row : row + 1, :, :length].contiguous()
            own_values = value[row : row + 1, :, :length].contiguous()
            out[row : row + 1, :, queries - own :] = attend(
                query[row : row + 1, :, queries - own :], own_keys, own_values, mask
            )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_attention)


def _linear_on_enough_rows(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, computed on at least MIN_GEMM_ROWS rows."""
    rows = x.shape[:-1].numel()
    if rows >= MIN_GEMM_ROWS:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    padded = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros((MIN_GEMM_ROWS - rows, x.shape[-1]))])
    return torch.nn.functional.linear(padded, module.weight, module.bias)[:rows].reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[None]:
    """The model with row_attention and its linear layers on at least MIN_GEMM_ROWS rows, then as it was."""
    before = model.config._attn_implementation
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    model.config._attn_implementation = ROW_ATTENTION
    for module in linears:
        module.forward = functools.partial(_linear_on_enough_rows, module)
    try:
        yield
    finally:
        model.config._attn_implementation = before
        for module in linears:
            del module.forward  # the class's forward again


class RowCache:
    """The KV cache while serving: per layer, keys and values [rows, kv heads, columns, head dim] with row
    r's tokens at columns 0 .. lengths[r] - 1 and anything finite after them. The model calls update()
    once per layer in a forward pass; `own` is set before it: how many of the block's last columns are
    each row's tokens (the block is right-aligned: its padding comes first)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]):
        self.layers, self.lengths = layers, lengths
        self.own: list[int] = []

    @classmethod
    def of(cls, kept: Sequence[Kept | None], template: Sequence[torch.Tensor]) -> RowCache:
        """A cache whose rows hold the kept rows' tokens (an empty row for None). `template`: a tensor per
        layer [kv heads, any, head dim] giving the shapes, dtype and device."""
        lengths = [len(row[0]) if row is not None else 0 for row in kept]
        width = _columns(max(lengths))
        layers = []
        for index, like in enumerate(template):
            keys = like.new_zeros((len(kept), like.shape[0], width, like.shape[-1]))
            values = torch.zeros_like(keys)
            for row, found in enumerate(kept):
                if found is not None:
                    keys[row, :, : lengths[row]], values[row, :, : lengths[row]] = found[1][index]
            layers.append((keys, values))
        return cls(layers, lengths)

    @property
    def width(self) -> int:
        return self.layers[0][0].shape[2]

    def reserve(self, own: list[int]) -> None:
        """Make room for each row's `own` next tokens (GROW columns more than needed: fewer copies)."""
        self.own = own
        if self.needed() > self.width:
            width = _columns(self.needed() + GROW)
            self.layers = [(_widened(k, width), _widened(v, width)) for k, v in self.layers]

    def needed(self) -> int:
        """The columns in use once the block is added."""
        return max(length + count for length, count in zip(self.lengths, self.own))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's own block tokens after its tokens (the model calls this once per layer)."""
        keys, values = self.layers[layer_idx]
        block = key_states.shape[2]
        if all(own == 1 for own in self.own):  # a decode step: one token per row, at its own length
            rows = torch.arange(len(self.lengths), device=keys.device)
            at = torch.tensor(self.lengths, device=keys.device)
            keys[rows, :, at], values[rows, :, at] = key_states[:, :, -1], value_states[:, :, -1]
        else:
            for row, (length, own) in enumerate(zip(self.lengths, self.own)):
                keys[row, :, length : length + own] = key_states[row, :, block - own :]
                values[row, :, length : length + own] = value_states[row, :, block - own :]
        return keys, values

    def layout(self, block: int, device: torch.device) -> Layout:
        """row_attention's view of the block about to be added (`block` columns wide)."""
        lengths = [length + own for length, own in zip(self.lengths, self.own)]
        if block > 1:
            return Layout(lengths, self.own, None)
        seen = torch.arange(self.width)[None, :] < torch.tensor(lengths)[:, None]
        mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[:, None, None]
        return Layout(lengths, self.own, mask.to(device))

    def positions(self, block: int) -> torch.Tensor:
        """The position of each column of a block `block` wide: a row's own token i at length + i (its
        column in the cache); padding at 0."""
        lengths, own = torch.tensor(self.lengths)[:, None], torch.tensor(self.own)[:, None]
        return (lengths - (block - own) + torch.arange(block)[None, :]).clamp(min=0)

    def added(self) -> None:
        """The forward pass is done: the rows now hold their block tokens too."""
        self.lengths = [length + own for length, own in zip(self.lengths, self.own)]

    def row(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row `index`'s keys and values (its tokens only)."""
        length = self.lengths[index]
        return [(keys[index, :, :length].clone(), values[index, :, :length].clone()) for keys, values in self.layers]

    def select(self, rows: list[int]) -> RowCache:
        """The cache of these rows only (its width cut to at most GROW past the longest: attention runs
        over every column)."""
        index = torch.tensor(rows, device=self.layers[0][0].device)
        lengths = [self.lengths[row] for row in rows]
        width = min(self.width, _columns(max(lengths) + GROW))
        # index_select last: its result is contiguous (the matmuls over a strided view gave other bits)
        layers = [
            (k[:, :, :width].index_select(0, index), v[:, :, :width].index_select(0, index)) for k, v in self.layers
        ]
        return RowCache(layers, lengths)

    def join(self, other: RowCache) -> RowCache:
        """This cache's rows, then `other`'s."""
        width = max(self.width, other.width)
        layers = [
            (torch.cat([_widened(k, width), _widened(ok, width)]), torch.cat([_widened(v, width), _widened(ov, width)]))
            for (k, v), (ok, ov) in zip(self.layers, other.layers)
        ]
        return RowCache(layers, self.lengths + other.lengths)


def _columns(count: int) -> int:
    """The cache width that holds `count` columns: a multiple of COLUMNS, at least one."""
    return max(1, -(-count // COLUMNS)) * COLUMNS


def _widened(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns added on the right up to `width`."""
    more = width - tensor.shape[2]
    if more <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((*tensor.shape[:2], more, tensor.shape[-1]))], dim=2)


def forward(
    model: torch.nn.Module, cache: RowCache, blocks: list[list[int]], pad_token_id: int, prefill: bool
) -> torch.Tensor:
    """Append each row's tokens (right-aligned in a block: a decode step's is one token wide, a prefill's
    at least two, so that row_attention tells them apart); return the logits of each row's last token."""
    width = max(2, *map(len, blocks)) if prefill else 1
    device = cache.layers[0][0].device
    block = torch.full((len(blocks), width), pad_token_id, dtype=torch.long)
    for row, tokens in enumerate(blocks):
        block[row, width - len(tokens) :] = torch.tensor(tokens)
    cache.reserve([len(tokens) for tokens in blocks])
    with TRANSFORMERS_GLOBALS:
        out = model(
            input_ids=block.to(device),
            attention_mask={"full_attention": cache.layout(width, device)},  # prepared: the model builds none
            position_ids=cache.positions(width).to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    cache.added()
    return out.logits[:, -1, :].float()


@dataclass
class Decoding:
    """A call in the batch."""

    tag: Any
    request: Request
    generator: torch.Generator
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def admit(
    model: torch.nn.Module, requests: Sequence[Request], kept: dict[int, Kept], pad_token_id: int
) -> tuple[RowCache, torch.Tensor]:
    """The requests' rows, their new tokens prefilled after their rollouts' kept rows (a request that does
    not extend its kept row prefills its whole context); and their logits. Requests with the same tokens
    and no kept row (a group's first calls: one prompt) are computed once."""
    start: list[Kept | None] = []
    for request in requests:
        row = kept.get(request.key)
        extends = (
            row is not None and len(row[0]) < len(request.token_ids) and request.token_ids[: len(row[0])] == row[0]
        )
        start.append(row if extends else None)
    unique: dict[Any, int] = {}
    copy_of = [
        unique.setdefault(tuple(r.token_ids) if row is None else ("row", i), len(unique))
        for i, (r, row) in enumerate(zip(requests, start))
    ]
    first = {index: i for i, index in reversed(list(enumerate(copy_of)))}
    computed = [first[index] for index in range(len(unique))]
    config, parameter = model.config, next(model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = parameter.new_zeros((config.num_key_value_heads, 0, head_dim))
    cache = RowCache.of([start[i] for i in computed], [shape] * config.num_hidden_layers)
    blocks = [requests[i].token_ids[len(start[i][0]) if start[i] is not None else 0 :] for i in computed]
    logits = forward(model, cache, blocks, pad_token_id, prefill=True)
    if len(computed) == len(requests):
        return cache, logits
    return cache.select(copy_of), logits[torch.tensor(copy_of, device=logits.device)]


@torch.no_grad()
def serve_continuously(
    model: torch.nn.Module,
    pad_token_id: int,
    eos: set[int],
    decode: Callable[[list[int]], str] | None,
    take: Callable[[bool], Sequence[tuple[Any, Request]] | None],
    give: Callable[[Any, Completion | Exception], None],
    sampling: Sampling,
) -> None:
    """Serve calls until take() says stop (engine.py's GenerationEngine.serve): each step admits the calls
    waiting, samples a token for every row, gives back the calls that ended and keeps their rows."""
    kept: dict[int, Kept] = {}  # rollout -> its row after its last call
    batch: list[Decoding] = []
    cache: RowCache | None = None
    logits: torch.Tensor | None = None  # each row's next-token logits
    with batch_invariant(model):
        while (arrived := take(not batch)) is not None:
            if arrived:
                joining, joining_logits = admit(model, [request for _, request in arrived], kept, pad_token_id)
                cache = joining if cache is None else cache.join(joining)
                logits = joining_logits if logits is None else torch.cat([logits, joining_logits])
                device = joining_logits.device
                batch += [
                    Decoding(tag, request, torch.Generator(device=device).manual_seed(request.seed))
                    for tag, request in arrived
                ]
            if not batch:
                continue
            tokens, chosen_logprobs = draw(logits, [call.generator for call in batch], sampling)
            going_on = []
            for index, (call, token, logprob) in enumerate(zip(batch, tokens.tolist(), chosen_logprobs)):
                call.sampled.append(token)
                call.logprobs.append(logprob)
                finish = finish_reason(call.request, call.sampled, eos, decode)
                if finish is None:
                    going_on.append(index)
                    continue
                # its last sampled token is not in the cache: the rollout's next call brings it
                kept[call.request.key] = (call.request.token_ids + call.sampled[:-1], cache.row(index))
                give(call.tag, Completion(call.sampled, call.logprobs, finish))
            if not going_on:
                batch, cache, logits = [], None, None
                continue
            if len(going_on) < len(batch):
                batch, tokens, cache = [batch[i] for i in going_on], tokens[going_on], cache.select(going_on)
            logits = forward(model, cache, [[token] for token in tokens.tolist()], pad_token_id, prefill=False)
