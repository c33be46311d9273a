"""The HF engine: exact batched decoding over a Hugging Face causal LM, with every rollout's KV
cache kept across turns, so a new turn prefills only its delta tokens (the last sampled token,
the observation and the generation prompt) instead of re-encoding the whole history. Each
rollout turn samples from its own seeded generator, so the same seed gives the same tokens
whatever else is in the batch. It is the reference the other engines are checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from schemas.features import FinishReason
from schemas.token_stream import rollouts
from stages.generate_rollouts.engine import ENGINES, Completion, EngineSettings, Generation, Request, Sampling
from stages.generate_rollouts.hf_serve import serve_continuously
from stages.generate_rollouts.sampling import draw, finish_reason, logprobs_of
from stages.policy.loading import TRANSFORMERS_GLOBALS, eos_token_ids, load_model

# A row that left the batch while decoding: its attention mask and every layer's (keys, values).
Retired = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


class HFEngine:
    """Batched decoding over a HF causal LM with a KV cache that survives between calls.

    The cache holds one row per rollout of the previous call. When every request extends the
    tokens its row already holds, those rows are kept (in the new order) and only the new
    tokens are prefilled; otherwise the cache is rebuilt from the full contexts. Rows are
    aligned by padding *between* segments (attention mask 0), with position ids counted over
    real tokens only, so results equal unpadded per-rollout decoding. Work nobody needs is not
    done: requests with the same tokens on an empty cache (a group's prompt) are prefilled once,
    and a row that finished leaves the batch until the turn ends (then it is put back).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        kept_kv_mb: float | None = None,
    ):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        self.decode = decode  # token ids -> text: needed only for stop strings
        self.max_model_len = getattr(model.config, "max_position_embeddings", None) or 10**9
        self.kept_kv_mb = kept_kv_mb  # serve(): the rollouts' kept KV rows hold at most this (None: no bound)
        self.reset()

    @classmethod
    def open(cls, model_dir: str | Path, tokenizer: Any, settings: EngineSettings) -> HFEngine:
        model = load_model(model_dir, settings.dtype, settings.device)
        eos = eos_token_ids(tokenizer, model)
        return cls(model, tokenizer.pad_token_id, eos, tokenizer.decode, kept_kv_mb=settings.kept_kv_mb)

    reloads_in_place = False  # loading the checkpoint is what opening costs

    def describe(self) -> dict[str, Any]:
        return {"name": "hf", "logprobs": "log_softmax(logits / temperature) of the same forward pass that sampled"}

    def load_policy(self, model_dir: str | Path) -> None:
        raise NotImplementedError("the HF engine is opened again on a new checkpoint")

    def close(self) -> None:
        self.reset()
        self.model = None

    def serve(
        self,
        take: Callable[[bool], Sequence[tuple[Any, Request]] | None],
        give: Callable[[Any, Completion | Exception], None],
        sampling: Sampling,
    ) -> None:
        """The agents' calls as they come: continuous, batch-invariant batching (hf_serve.py)."""
        self.reset()  # serve() keeps its own cache; the turns' cache would not continue after it
        eos = set(self.eos_token_ids.tolist())
        kept_bytes = None if self.kept_kv_mb is None else self.kept_kv_mb * 2**20
        serve_continuously(self.model, self.pad_token_id, eos, self.decode, take, give, sampling, kept_bytes)

    def generate(
        self,
        requests: Sequence[Request],
        sampling: Sampling,
        earlier_turns: Callable[[], datasets.Dataset] | None = None,
        report_progress: Callable[[float], None] | None = None,
    ) -> Generation:
        """A completion for every request; a cache that cannot continue the requests (a resumed
        run) is first rebuilt by replaying the stored `earlier_turns()`."""
        replayed = None
        if earlier_turns is not None and requests and not self.can_continue(requests):
            history = earlier_turns()
            replayed = {
                "turns": len(set(history["turn"])),
                "max_abs_logprob_difference": self.replay(history, sampling),
            }
        return Generation(self.sample(requests, sampling, report_progress=report_progress), replayed)

    def reset(self) -> None:
        """Forget the batch's cache."""
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cached length], 1 on real tokens
        self._keys: list[int] = []
        self._cached_tokens: list[list[int]] = []  # real tokens each row's cache holds

    def can_continue(self, requests: Sequence[Request]) -> bool:
        """Does the cache hold a prefix of every request (so only new tokens are prefilled)?"""
        return self._reusable_rows(requests) is not None

    def _reusable_rows(self, requests: Sequence[Request]) -> list[int] | None:
        row_of = {key: row for row, key in enumerate(self._keys)}
        rows = []
        for request in requests:
            row = row_of.get(request.key)
            if row is None:
                return None
            cached = self._cached_tokens[row]
            if len(cached) >= len(request.token_ids) or request.token_ids[: len(cached)] != cached:
                return None
            rows.append(row)
        return rows

    def _compact(self) -> None:
        """Drop the masked columns (pads between segments) from the cache, keeping each row's
        real tokens in order, right-aligned: the cache grows with real tokens only, not with
        every turn's padding (which would make 50-turn rollouts quadratically slower)."""
        real = self._mask.bool()
        width = int(real.sum(-1).max())
        if width == self._mask.shape[1]:
            return
        # For each row, the columns of its real tokens, right-aligned into `width` slots.
        order = torch.sort(real.to(torch.int8), dim=-1, stable=True).indices[:, -width:]
        for layer in self._cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self._mask = self._mask.gather(1, order)

    def _forward(self, input_ids: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Append a block of tokens to every row; return the logits of the block's last column."""
        mask = new_mask if self._mask is None else torch.cat([self._mask, new_mask], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        # `cache` (argument and output field) is transformers' name since 5.24; `past_key_values`
        # warns there and goes in 5.40. 5.23 and older know only `past_key_values` (their outputs
        # have no `cache`), hence pyproject.toml's transformers>=5.24.
        with TRANSFORMERS_GLOBALS:  # not while another thread's from_pretrained changes them
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._cache, self._mask = out.cache, mask
        return out.logits[:, -1, :].float()

    def _prefill(self, new_tokens: list[list[int]], shared: bool) -> torch.Tensor:
        """Append each row's new tokens, left-padded so every row ends at the last column; return
        the last column's logits. With `shared` (an empty cache), requests with the same tokens
        (a group's rollouts at turn 0: one prompt, G samples) are computed once and their rows
        copied: at G = 8 that is an eighth of turn 0's prefill."""
        unique: dict[tuple[int, ...], int] = {}
        copy_of = [unique.setdefault(tuple(tokens), len(unique)) for tokens in new_tokens] if shared else None
        computed = [list(tokens) for tokens in unique] if shared else new_tokens
        width = max(len(tokens) for tokens in computed)
        block = torch.full((len(computed), width), self.pad_token_id, dtype=torch.long)
        block_mask = torch.zeros((len(computed), width), dtype=torch.long)
        for row, tokens in enumerate(computed):
            block[row, width - len(tokens) :] = torch.tensor(tokens)
            block_mask[row, width - len(tokens) :] = 1
        logits = self._forward(block.to(self.device), block_mask.to(self.device))
        if copy_of is None or len(computed) == len(new_tokens):
            return logits
        index = torch.tensor(copy_of, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        return logits[index]

    def _retire(self, live: list[int], going_on: list[int]) -> dict[int, Retired]:
        """Take the rows not in `going_on` out of the cache; returns them by request (`live`
        maps the cache's rows to requests)."""
        staying = set(going_on)
        leaving = {
            request: (
                self._mask[row].clone(),
                [(layer.keys[row].clone(), layer.values[row].clone()) for layer in self._cache.layers],
            )
            for row, request in enumerate(live)
            if row not in staying
        }
        self._cache.batch_select_indices(torch.tensor(going_on, device=self.device))
        self._mask = self._mask[going_on]
        return leaving

    def _readmit(self, live: list[int], retired: dict[int, Retired]) -> None:
        """Put the rows that left the batch while decoding back beside the `live` ones, in request
        order, right-aligned (shorter rows padded on the left, masked): the cache then holds a
        row for every request, as if all had decoded to the end."""
        if not retired:
            return
        count, width = len(live) + len(retired), self._mask.shape[1]
        starts = {request: width - row_mask.shape[0] for request, (row_mask, _) in retired.items()}
        mask = self._mask.new_zeros((count, width))
        mask[live] = self._mask
        for request, (row_mask, _) in retired.items():
            mask[request, starts[request] :] = row_mask
        for index, layer in enumerate(self._cache.layers):
            keys = layer.keys.new_zeros((count, *layer.keys.shape[1:]))
            values = layer.values.new_zeros((count, *layer.values.shape[1:]))
            keys[live], values[live] = layer.keys, layer.values
            for request, (_, layers) in retired.items():
                keys[request, :, starts[request] :], values[request, :, starts[request] :] = layers[index]
            layer.keys, layer.values = keys, values
        self._mask = mask

    @torch.no_grad()
    def sample(
        self,
        requests: Sequence[Request],
        sampling: Sampling,
        forced: Sequence[Sequence[int]] | None = None,
        report_progress: Callable[[float], None] | None = None,
    ) -> list[Completion]:
        """Sample a completion for every request, one batch, continuing the cache when it can.
        `report_progress` gets the share of the token budget (the longest max_new_tokens)
        decoded so far after every token, and 1.0 when all rows stop.

        With `forced` the tokens are given instead of sampled (a replay): every forward pass
        has the same shapes and inputs as when they were sampled, so the KV cache ends up
        bit-identical and so do the logprobs, which are returned for checking."""
        if not requests:
            return []
        if self.decode is None and any(request.stop for request in requests):
            raise ValueError("stop strings need the engine's decode function (HFEngine(..., decode=tokenizer.decode))")
        rows = self._reusable_rows(requests)
        if rows is None:
            self.reset()
            self._cache = DynamicCache(config=self.model.config)
            new_tokens = [r.token_ids for r in requests]
        else:
            self._cache.batch_select_indices(torch.tensor(rows, device=self.device))
            self._mask = self._mask[rows]
            new_tokens = [r.token_ids[len(self._cached_tokens[row]) :] for r, row in zip(requests, rows)]
        logits = self._prefill(new_tokens, shared=rows is None and self._mask is None)

        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in requests]
        limits = [r.max_new_tokens for r in requests]
        eos = set(self.eos_token_ids.tolist())
        progress = tqdm(total=max(limits), desc="decode", unit="tok", leave=False, disable=None)
        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        live = list(range(len(requests)))  # the requests the cache's rows hold, in row order
        retired: dict[int, Retired] = {}  # request -> its row, once it left the batch
        while True:
            if forced is None:
                tokens, chosen_logprobs = draw(logits, [generators[i] for i in live], sampling)
            else:
                tokens = torch.tensor([forced[i][len(sampled[i])] for i in live], device=self.device)
                chosen_logprobs = logprobs_of(logits, tokens, sampling)
            for i, token, logprob in zip(live, tokens.tolist(), chosen_logprobs):
                sampled[i].append(token)
                logprobs[i].append(logprob)
                if forced is not None:
                    finish[i] = FinishReason.REPLAYED if len(sampled[i]) == len(forced[i]) else None
                else:
                    finish[i] = finish_reason(requests[i], sampled[i], eos, self.decode)
            progress.update()
            finished = all(f is not None for f in finish)
            if report_progress is not None:
                report_progress(1.0 if finished else max(map(len, sampled)) / max(limits))
            if finished:
                break
            # Rows that finished leave the batch: the rest decode without computing them (a
            # turn's completions differ in length, 2x on SmolLM2's calculator rollouts).
            going_on = [row for row, i in enumerate(live) if finish[i] is None]
            if len(going_on) < len(live):
                retired.update(self._retire(live, going_on))
                live, tokens = [live[row] for row in going_on], tokens[going_on]
            logits = self._forward(tokens[:, None], torch.ones((len(live), 1), dtype=torch.long, device=self.device))

        progress.close()
        self._readmit(live, retired)
        self._compact()
        # The last sampled token of each row is not in the cache yet; it is fed next turn.
        self._keys = [r.key for r in requests]
        self._cached_tokens = [r.token_ids + s[:-1] for r, s in zip(requests, sampled)]
        return [Completion(s, lp, f or FinishReason.LENGTH) for s, lp, f in zip(sampled, logprobs, finish)]

    def replay(self, history: datasets.Dataset, sampling: Sampling) -> float:
        """Rebuild the engine's cache by replaying the stored turns exactly as they were generated
        (same batches, same forward passes, sampled tokens given). A resumed run then continues
        with bit-identical numerics. Returns the max |replayed - stored| logprob (0 when exact)."""
        columns = history.select_columns(["sampling_seed", "finish_reason", "completion_logprobs"]).to_dict()
        earlier = rollouts(history)
        worst = 0.0
        self.reset()
        for turn in sorted({t for rollout in earlier for t in rollout.turns}):
            # the batch of that turn: its rollouts that generated, by rollout_id
            batch = [(r, r.turns.index(turn)) for r in earlier if turn in r.turns]
            batch = [(r, p) for r, p in batch if columns["finish_reason"][r.rows[p]] != FinishReason.FAILED]
            requests = [
                Request(r.rollout_id, r.stream_before(p), columns["sampling_seed"][r.rows[p]], 1) for r, p in batch
            ]
            forced = [r.token_ids[slice(*r.completion_spans[p])] for r, p in batch]
            replayed = self.sample(requests, sampling, forced=forced)
            for (r, p), completion in zip(batch, replayed):
                for new, old in zip(completion.logprobs, columns["completion_logprobs"][r.rows[p]]):
                    worst = max(worst, abs(new - old))
        return worst


ENGINES["hf"] = HFEngine.open
