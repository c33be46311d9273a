"""The generation-engine protocol: what generate-rollouts needs from an engine.

Token ids in, token ids out: a request is a rollout's whole context as token ids, a completion
is the sampled token ids with their logprobs under the convention

    logprobs[i] = log_softmax(logits / temperature)[token_i], before top-k/top-p truncation,

and a finish reason. An engine never returns text that mtrl would re-tokenize. Engines are
opened for one policy checkpoint by name (`generation.engine`) from ENGINES; the HF engine
(stages/generate_rollouts/hf.py) is the exact reference. See docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import datasets

from schemas.config import RunConfig
from schemas.features import FinishReason


@dataclass
class Request:
    key: int  # identifies the rollout whose KV cache may be reused
    token_ids: list[int]  # the whole context the model sees
    seed: int  # seed of this turn's private generator
    max_new_tokens: int
    stop: tuple[str, ...] = ()  # stop strings (besides the EOS tokens)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off


@dataclass
class Generation:
    completions: list[Completion]  # one per request, in order
    # How the engine rebuilt its state from the earlier turns before generating (a resumed run):
    # {"turns": ..., "max_abs_logprob_difference": ...}, or None when it did not need to.
    replay: dict[str, Any] | None = None


class GenerationEngine(Protocol):
    max_model_len: int  # the longest context (prompt + completion) the model takes
    # Can load_policy serve the next checkpoint exactly and cheaper than closing and opening the
    # engine again? If not, the flow closes the engine after an iteration's last turn (freeing
    # its memory for the update) and opens it on the next policy.
    reloads_in_place: bool

    def generate(
        self,
        requests: Sequence[Request],
        sampling: Sampling,
        earlier_turns: datasets.Dataset | None = None,
        report_progress: Callable[[float], None] | None = None,
    ) -> Generation:
        """A completion for every request. `earlier_turns` are the rollouts' stored earlier turns
        (execute-tools rows), for an engine that must rebuild its state to continue exactly;
        `report_progress`, when given, is called with the share of the work done (0 to 1)."""
        ...

    def close(self) -> None:
        """Free what the engine holds (weights, caches, a server)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the manifest's provenance records about the engine (name, version, settings)."""
        ...

    def load_policy(self, model_dir: str | Path) -> None:
        """Serve another checkpoint in place (called only when reloads_in_place)."""
        ...


# name -> open(model_dir, tokenizer, config): an engine serving that checkpoint, configured by
# the run config (model.dtype, model.device, generation, and the engine's own section)
ENGINES: dict[str, Callable[[str | Path, Any, RunConfig], GenerationEngine]] = {}


def open_engine(model_dir: str | Path, tokenizer: Any, config: RunConfig) -> GenerationEngine:
    name = config.generation.engine
    if name not in ENGINES:
        raise ValueError(f"unknown generation engine '{name}'; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model_dir, tokenizer, config)
