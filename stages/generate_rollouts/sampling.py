"""Choosing tokens from logits, shared by the HF engine's two ways of decoding (hf.py: turns in lock-step;
hf_serve.py: agents' calls as they come): top-k/top-p, one seeded uniform per row, the logprob
convention of engine.py, and why a row stops."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from schemas.features import FinishReason
from stages.generate_rollouts.engine import Request, Sampling


def filter_logits(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p truncation of temperature-scaled logits (removed entries -> -inf)."""
    if top_k > 0 and top_k < scaled_logits.shape[-1]:
        kth = torch.topk(scaled_logits, top_k, dim=-1).values[..., -1:]
        scaled_logits = scaled_logits.masked_fill(scaled_logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled_logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scaled_logits = scaled_logits.masked_fill(remove, float("-inf"))
    return scaled_logits


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> list[float]:
    """The tokens' logprobs under the stored convention: log_softmax(logits / temperature)."""
    return torch.log_softmax(logits / sampling.temperature, dim=-1).gather(-1, tokens[:, None])[:, 0].tolist()


def draw(
    logits: torch.Tensor, generators: Sequence[torch.Generator], sampling: Sampling
) -> tuple[torch.Tensor, list[float]]:
    """One token per row and its logprob. Inverse-CDF sampling with one uniform per row from the row's
    own generator: vectorised, and a row's tokens do not depend on the rest of the batch."""
    scaled = logits / sampling.temperature
    probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
    uniforms = torch.stack(
        [torch.rand((), generator=generator, device=logits.device, dtype=torch.float32) for generator in generators]
    )
    cumulative = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None])[:, 0]
    tokens = tokens.clamp(max=probs.shape[-1] - 1)
    return tokens, logprobs_of(logits, tokens, sampling)


def finish_reason(
    request: Request, sampled: list[int], eos: set[int], decode: Callable[[list[int]], str] | None
) -> FinishReason | None:
    """Why the row stops after its latest token, or None if it goes on."""
    if sampled[-1] in eos:
        return FinishReason.STOP
    if request.stop and any(stop in decode(sampled) for stop in request.stop):
        return FinishReason.STOP_STRING
    if len(sampled) >= request.max_new_tokens:
        return FinishReason.LENGTH
    return None
