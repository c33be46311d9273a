"""The HF engine serving agents' calls as they come (HFEngine.serve): continuous batching with
batch-invariant numbers.

Agents call when their own tools are done, so calls arrive at any moment. A call joins the batch at
the next decode step (its new tokens prefilled after its rollout's kept row) and leaves it when it
ends, its completion given back at once: no call waits for another's longest completion, no
lock-step turns. Each rollout's row is kept when its call ends, so its next call prefills only the
tokens the agent added. The kept rows hold at most a memory budget (KeptRows): past it the least
recently used give up their keys and values, which their rollout's next call computes again, alone,
by the forward passes that first computed them (the same bits).

Which calls share a forward pass is timing, so a row's numbers must not depend on it: then a
re-run (a resumed one) samples the same bytes whatever batches its calls met. What made a row's
numbers depend on its batch (measured, torch 2.13 on CPU):

- a GEMM computes a row differently by the number of rows M: below a threshold that depends on the
  layer's shape and the thread count, identically from there on (this model: 6 rows for its layers of
  128 inputs, 16 for its down projection of 384 on one thread; layers of 1024-4096 inputs on two
  threads, whose sums MKL splits between the threads: 129 to 513 rows);
- a matmul's sum over more than 384 terms runs in blocks whose size depends on the number of terms,
  so attention over a wider cache gave a row of 250 tokens other bits at every width from 400 to 496;
- attention over padded keys (the reductions run over the padding, shifted by it).

So, while serving:

- every linear layer runs as GEMMs of GEMM_ROWS rows (zero rows added, then dropped), at least two,
  in one batched matmul: each is a GEMM of the same shape on one thread, whatever the batch;
- the cache holds each row's tokens at columns 0 .. length - 1 (left-aligned, RowCache) in a width
  that is a multiple of TILE; a decode step weighs the values in matmuls of TILE columns summed tile
  after tile (a row's tiles past its tokens add exact zeros), a prefill block attends row by row over
  exactly the row's tokens (row_attention).

Sampling is seeded per call (sampling.draw), so the same call gives the same tokens too.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import AttentionInterface

from stages.generate_rollouts.engine import CancelledRequestError, Completion, Request, Sampling
from stages.generate_rollouts.sampling import draw, finish_reason
from stages.policy.loading import TRANSFORMERS_GLOBALS

ROW_ATTENTION = "mtrl_rows"  # the attention implementation's name while serving
# The rows of each GEMM a linear layer runs as. Smaller costs a decode step of few rows less (it computes at
# least two chunks), larger a long prefill less (fewer chunks); 16 measured the cheapest here.
GEMM_ROWS = 16
# The cache's width is a multiple of TILE, and a decode step's weighted sum of values runs in matmuls of TILE
# columns: each one sum, below the 384 terms where a matmul starts to split its sums by their count.
TILE = 64

# A row's keys [KV heads, head dim, tokens] and values [KV heads, tokens, head dim], layer by layer
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Layout:
    """What row_attention needs to know of RowCache's rows, given to the model as its prepared mask: how
    many tokens each row holds once the block is added, how many of the block's last columns are its
    own, and the additive masks (0 where a query sees a key, -inf elsewhere): for a prefill block each
    row's [own, length] (causal), for a decode step one [rows, 1, 1, cache columns]."""

    lengths: list[int]
    own: list[int]
    prefill_masks: list[torch.Tensor] | None
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
    """Attention over RowCache's layout (its keys transposed: [B, KV, D, columns]). The query heads that share
    a KV head are stacked as rows of one matmul (no copy of the keys): [B, H, Q, D] -> [B, KV, H / KV * Q, D].
    A decode step (one query per row) runs batched over every cache column, the values weighed tile by
    tile (_tiled_weighted_sum): the columns past a row's tokens get weight 0 and add exact zeros. A
    prefill block runs row by row over exactly the row's tokens and queries."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    query = query * (scaling if scaling is not None else dim**-0.5)

    def weights(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(query . key + mask), the stacked queries' rows: [rows, KV, groups * count, columns]."""
        rows, _, count, _ = query.shape
        stacked = query.reshape(rows, kv_heads, groups * count, dim)
        scores = torch.matmul(stacked, key).view(rows, kv_heads, groups, count, -1)
        return (scores + mask).softmax(-1).view(rows, kv_heads, groups * count, -1)

    if attention_mask.decode_mask is not None:
        decoded = _tiled_weighted_sum(weights(query, key, attention_mask.decode_mask[:, :, None]), value)
        out = decoded.reshape(batch, heads, 1, dim)
    else:
        out = query.new_zeros(query.shape)  # a padding query's output is never read
        rows = zip(attention_mask.lengths, attention_mask.own, attention_mask.prefill_masks)
        for row, (length, own, mask) in enumerate(rows):
            own_keys = key[row : row + 1, :, :, :length].contiguous()
            own_values = value[row : row + 1, :, :length].contiguous()
            row_weights = weights(query[row : row + 1, :, queries - own :], own_keys, mask)
            out[row : row + 1, :, queries - own :] = torch.matmul(row_weights, own_values).reshape(1, heads, own, dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_attention)


def _tiled_weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights [rows, KV, count, columns] @ values [rows, KV, columns, dim] as matmuls of TILE columns, summed
    tile after tile: each sum has the same terms in the same order whatever the number of columns."""
    rows, kv_heads, count, columns = weights.shape
    tiles = columns // TILE
    parts = torch.matmul(
        weights.view(rows, kv_heads, count, tiles, TILE).transpose(2, 3).contiguous(),
        values.view(rows, kv_heads, tiles, TILE, values.shape[-1]),
    )  # [rows, KV, tiles, count, dim]
    total = parts[:, :, 0]
    for tile in range(1, tiles):
        total = total + parts[:, :, tile]
    return total


def _linear_in_chunks(transposed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward (`transposed`: its weight transposed, contiguous) as GEMMs of GEMM_ROWS rows each,
    at least two (zero rows added, then dropped), in one batched matmul: torch runs its items in parallel,
    each on one thread (a single GEMM would be split between the threads by its size)."""
    rows = x.shape[:-1].numel()
    chunks = max(2, -(-rows // GEMM_ROWS))
    flat = x.reshape(rows, x.shape[-1])
    if chunks * GEMM_ROWS > rows:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, chunks * GEMM_ROWS - rows))
    out = torch.bmm(flat.view(chunks, GEMM_ROWS, -1), transposed.expand(chunks, *transposed.shape))
    out = out.view(chunks * GEMM_ROWS, -1)[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[None]:
    """The model with row_attention and its linear layers in chunks, then as it was. Each linear layer's
    weight is copied transposed meanwhile (the batched matmul over a transposed view ran 1.5-2x slower)."""
    before = model.config._attn_implementation
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    model.config._attn_implementation = ROW_ATTENTION
    for module in linears:
        module.forward = functools.partial(_linear_in_chunks, module.weight.t().contiguous(), module.bias)
    try:
        yield
    finally:
        model.config._attn_implementation = before
        for module in linears:
            del module.forward  # the class's forward again


class RowCache:
    """The KV cache while serving: per layer, keys [rows, kv heads, head dim, columns] (transposed: a decode
    step's scores then read them in a plain matmul, 2-3x faster than through a transposed view) and values
    [rows, kv heads, columns, head dim], row r's tokens at columns 0 .. lengths[r] - 1 and anything finite
    after them. The model calls update() once per layer in a forward pass; `own` is set before it: how many
    of the block's last columns are each row's tokens (the block is right-aligned: its padding comes first)."""

    def __init__(self, layers: LayerKV, lengths: list[int]):
        self.layers, self.lengths = layers, lengths
        self.own: list[int] = []

    @classmethod
    def of(cls, model: torch.nn.Module, rows: Sequence[LayerKV | None]) -> RowCache:
        """A cache whose rows hold these keys and values (an empty row for None)."""
        config, parameter = model.config, next(model.parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        lengths = [row[0][1].shape[1] if row is not None else 0 for row in rows]
        width = _columns(max(lengths))
        layers = []
        for index in range(config.num_hidden_layers):
            keys = parameter.new_zeros((len(rows), config.num_key_value_heads, head_dim, width))
            values = parameter.new_zeros((len(rows), config.num_key_value_heads, width, head_dim))
            for row, found in enumerate(rows):
                if found is not None:
                    keys[row, :, :, : lengths[row]], values[row, :, : lengths[row]] = found[index]
            layers.append((keys, values))
        return cls(layers, lengths)

    @property
    def width(self) -> int:
        return self.layers[0][1].shape[2]

    def reserve(self, own: list[int]) -> None:
        """Make room for each row's `own` next tokens."""
        self.own = own
        needed = max(length + count for length, count in zip(self.lengths, self.own))
        if needed > self.width:
            width = _columns(needed)
            self.layers = [_widened(layer, width) for layer in self.layers]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's own block tokens after its tokens (the model calls this once per layer)."""
        keys, values = self.layers[layer_idx]
        block = key_states.shape[2]
        if all(own == 1 for own in self.own):  # a decode step: one token per row, at its own length
            rows = torch.arange(len(self.lengths), device=keys.device)
            at = torch.tensor(self.lengths, device=keys.device)
            keys[rows, :, :, at], values[rows, :, at] = key_states[:, :, -1], value_states[:, :, -1]
        else:
            for row, (length, own) in enumerate(zip(self.lengths, self.own)):
                keys[row, :, :, length : length + own] = key_states[row, :, block - own :].transpose(-1, -2)
                values[row, :, length : length + own] = value_states[row, :, block - own :]
        return keys, values

    def layout(self, block: int, device: torch.device) -> Layout:
        """row_attention's view of the block about to be added (`block` columns wide)."""
        lengths = [length + own for length, own in zip(self.lengths, self.own)]
        if block > 1:
            masks = []
            for length, own in zip(lengths, self.own):
                causal = torch.ones((own, length), dtype=torch.bool).tril(length - own)
                masks.append(torch.zeros(causal.shape).masked_fill(~causal, float("-inf")).to(device))
            return Layout(lengths, self.own, masks, None)
        seen = torch.arange(self.width)[None, :] < torch.tensor(lengths)[:, None]
        mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[:, None, None]
        return Layout(lengths, self.own, None, mask.to(device))

    def positions(self, block: int) -> torch.Tensor:
        """The position of each column of a block `block` wide: a row's own token i at length + i (its
        column in the cache); padding at 0."""
        lengths, own = torch.tensor(self.lengths)[:, None], torch.tensor(self.own)[:, None]
        return (lengths - (block - own) + torch.arange(block)[None, :]).clamp(min=0)

    def added(self) -> None:
        """The forward pass is done: the rows now hold their block tokens too."""
        self.lengths = [length + own for length, own in zip(self.lengths, self.own)]

    def row(self, index: int) -> LayerKV:
        """A copy of row `index`'s keys and values (its tokens only), as the cache holds them."""
        length = self.lengths[index]
        return [(k[index, :, :, :length].clone(), v[index, :, :length].clone()) for k, v in self.layers]

    def select(self, rows: list[int]) -> RowCache:
        """The cache of these rows only (its width cut to what the longest needs: attention runs over every
        column)."""
        index = torch.tensor(rows, device=self.layers[0][1].device)
        lengths = [self.lengths[row] for row in rows]
        width = min(self.width, _columns(max(lengths)))
        # index_select last: its result is contiguous (the matmuls over a strided view gave other bits)
        layers = [
            (k[..., :width].index_select(0, index), v[:, :, :width].index_select(0, index)) for k, v in self.layers
        ]
        return RowCache(layers, lengths)

    def join(self, other: RowCache) -> RowCache:
        """This cache's rows, then `other`'s."""
        width = max(self.width, other.width)
        layers = []
        for mine, theirs in zip(self.layers, other.layers):
            (k, v), (ok, ov) = _widened(mine, width), _widened(theirs, width)
            layers.append((torch.cat([k, ok]), torch.cat([v, ov])))
        return RowCache(layers, self.lengths + other.lengths)


def _columns(count: int) -> int:
    """The cache width that holds `count` columns: a multiple of TILE, at least one."""
    return max(1, -(-count // TILE)) * TILE


def _widened(layer: tuple[torch.Tensor, torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (keys, values) with zero columns added on the right up to `width`."""
    keys, values = layer
    more = width - values.shape[2]
    if more <= 0:
        return keys, values
    keys = torch.cat([keys, keys.new_zeros((*keys.shape[:3], more))], dim=3)
    values = torch.cat([values, values.new_zeros((*values.shape[:2], more, values.shape[3]))], dim=2)
    return keys, values


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


# How a row's tokens were computed, in order: a prefill block of n tokens, or n decode steps of one token.
Passes = list[tuple[Literal["prefill", "decode"], int]]


@dataclass
class KeptRow:
    """A rollout's row after its last call: its tokens, the forward passes that computed them, and every
    layer's keys and values of them (None once KeptRows dropped them: replayed() computes them again)."""

    tokens: list[int]
    passes: Passes
    layers: LayerKV | None

    def size(self) -> int:
        """The bytes its keys and values take."""
        return sum(t.numel() * t.element_size() for pair in self.layers or [] for t in pair)


class KeptRows:
    """Each rollout's row after its last call, by rollout, holding keys and values of at most `budget_bytes`
    (None: no bound): past it the least recently used rows drop theirs."""

    def __init__(self, budget_bytes: float | None):
        self.budget = budget_bytes
        self.rows: OrderedDict[int, KeptRow] = OrderedDict()  # least recently used first
        self.held = 0  # bytes of keys and values held

    def get(self, key: int) -> KeptRow | None:
        row = self.rows.get(key)
        if row is not None:
            self.rows.move_to_end(key)
        return row

    def keep(self, key: int, row: KeptRow) -> None:
        """Keep `row` for its rollout (in place of the one before), then drop the keys and values of the
        least recently used rows (this one last) while they take more than the budget."""
        if key in self.rows:
            self.held -= self.rows.pop(key).size()
        self.rows[key] = row
        self.held += row.size()
        for oldest in self.rows.values():
            if self.budget is None or self.held <= self.budget:
                break
            self.held -= oldest.size()
            oldest.layers = None


def replayed(model: torch.nn.Module, row: KeptRow, pad_token_id: int) -> LayerKV:
    """The keys and values of a row whose layers were dropped, computed again, alone, by the forward passes
    that first computed them: the same bits, since a row's numbers do not depend on its batch."""
    cache = RowCache.of(model, [None])
    done = 0
    for kind, count in row.passes:
        tokens = row.tokens[done : done + count]
        if kind == "prefill":
            forward(model, cache, [tokens], pad_token_id, prefill=True)
        else:
            for token in tokens:
                forward(model, cache, [[token]], pad_token_id, prefill=False)
        done += count
    return cache.row(0)


def _layers_of(model: torch.nn.Module, row: KeptRow | None, pad_token_id: int) -> LayerKV | None:
    """A kept row's keys and values, replayed if they were dropped (None for no row)."""
    if row is None:
        return None
    return row.layers if row.layers is not None else replayed(model, row, pad_token_id)


@dataclass
class Decoding:
    """A call in the batch."""

    tag: Any
    request: Request
    generator: torch.Generator
    passes: Passes  # how its row's tokens were computed, up to its prefill
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def admit(
    model: torch.nn.Module, requests: Sequence[Request], kept: KeptRows, pad_token_id: int
) -> tuple[RowCache, torch.Tensor, list[Passes]]:
    """The requests' rows, their new tokens prefilled after their rollouts' kept rows (a request that does
    not extend its kept row prefills its whole context); their logits; how each row's tokens were
    computed. A kept row whose keys and values were dropped is replayed first. Requests with the same
    tokens and no kept row (a group's first calls: one prompt) are computed once."""
    start: list[KeptRow | None] = []
    for request in requests:
        row = kept.get(request.key)
        extends = (
            row is not None
            and len(row.tokens) < len(request.token_ids)
            and request.token_ids[: len(row.tokens)] == row.tokens
        )
        start.append(row if extends else None)
    unique: dict[Any, int] = {}
    copy_of = [
        unique.setdefault(tuple(r.token_ids) if row is None else ("row", i), len(unique))
        for i, (r, row) in enumerate(zip(requests, start))
    ]
    first = {index: i for i, index in reversed(list(enumerate(copy_of)))}
    computed = [first[index] for index in range(len(unique))]
    rows = [start[i] for i in computed]
    cache = RowCache.of(model, [_layers_of(model, row, pad_token_id) for row in rows])
    blocks = [requests[i].token_ids[len(row.tokens) if row is not None else 0 :] for i, row in zip(computed, rows)]
    logits = forward(model, cache, blocks, pad_token_id, prefill=True)
    passes: list[Passes] = [
        (row.passes if row is not None else []) + [("prefill", len(block))] for row, block in zip(rows, blocks)
    ]
    if len(computed) == len(requests):
        return cache, logits, passes
    return cache.select(copy_of), logits[torch.tensor(copy_of, device=logits.device)], [passes[i] for i in copy_of]


@torch.no_grad()
def serve_continuously(
    model: torch.nn.Module,
    pad_token_id: int,
    eos: set[int],
    decode: Callable[[list[int]], str] | None,
    take: Callable[[bool], Sequence[tuple[Any, Request]] | None],
    give: Callable[[Any, Completion | Exception], None],
    sampling: Sampling,
    kept_bytes: float | None = None,
) -> None:
    """Serve calls until take() says stop (engine.py's GenerationEngine.serve): each step admits the calls
    waiting, samples a token for every row, gives back the calls that ended and keeps their rows, their
    keys and values of at most `kept_bytes` (None: no bound)."""
    kept = KeptRows(kept_bytes)
    batch: list[Decoding] = []
    cache: RowCache | None = None
    logits: torch.Tensor | None = None  # each row's next-token logits
    with batch_invariant(model):
        while (arrived := take(not batch)) is not None:
            if arrived:
                joining, joining_logits, passes = admit(model, [request for _, request in arrived], kept, pad_token_id)
                cache = joining if cache is None else cache.join(joining)
                logits = joining_logits if logits is None else torch.cat([logits, joining_logits])
                device = joining_logits.device
                batch += [
                    Decoding(tag, request, torch.Generator(device=device).manual_seed(request.seed), row_passes)
                    for (tag, request), row_passes in zip(arrived, passes)
                ]
            if not batch:
                continue
            tokens, chosen_logprobs = draw(logits, [call.generator for call in batch], sampling)
            going_on = []
            for index, (call, token, logprob) in enumerate(zip(batch, tokens.tolist(), chosen_logprobs)):
                if call.request.cancelled():  # nobody waits for it: dropped, its row not kept
                    give(call.tag, CancelledRequestError(call.sampled))
                    continue
                call.sampled.append(token)
                call.logprobs.append(logprob)
                finish = finish_reason(call.request, call.sampled, eos, decode)
                if finish is None:
                    going_on.append(index)
                    continue
                # its last sampled token is not in the cache: the rollout's next call brings it
                decoded = len(call.sampled) - 1
                passes = call.passes + ([("decode", decoded)] if decoded else [])
                row = KeptRow(call.request.token_ids + call.sampled[:-1], passes, cache.row(index))
                kept.keep(call.request.key, row)
                give(call.tag, Completion(call.sampled, call.logprobs, finish))
            if not going_on:
                batch, cache, logits = [], None, None
                continue
            if len(going_on) < len(batch):
                batch, tokens, cache = [batch[i] for i in going_on], tokens[going_on], cache.select(going_on)
            logits = forward(model, cache, [[token] for token in tokens.tolist()], pad_token_id, prefill=False)
