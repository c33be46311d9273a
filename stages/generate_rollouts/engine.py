"""The generation-engine protocol: what generate-rollouts needs from an engine.

Token ids in, token ids out: a request is a rollout's whole context as token ids, a completion
is the sampled token ids with their logprobs under the convention

    logprobs[i] = log_softmax(logits / temperature)[token_i], before top-k/top-p truncation,

and a finish reason. An engine never returns text that mtrl would re-tokenize. Engines are
opened for one policy checkpoint by name (`generation.engine`) from ENGINES, with the settings
they read (EngineSettings); the HF engine (hf.py) is the exact reference. The process keeps one
engine open for the current policy (ENGINE), from turn to turn. See docs/extending.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import datasets
from pydantic import computed_field

from runtime.vllm_server import vllm_version
from schemas.features import FinishReason
from schemas.stage import Settings, read
from stages.policy.loading import Device


def _never() -> bool:
    return False


@dataclass
class Request:
    key: int  # identifies the rollout whose KV cache may be reused
    token_ids: list[int]  # the whole context the model sees
    seed: int  # seed of this turn's private generator
    max_new_tokens: int
    stop: tuple[str, ...] = ()  # stop strings (besides the EOS tokens)
    # serve(): true once nobody waits for the completion (the agent's client went away); the engine then
    # stops sampling it and gives back CancelledRequestError in its place
    cancelled: Callable[[], bool] = _never


class CancelledRequestError(Exception):
    """What serve() gives back for a request it stopped sampling because `cancelled()` became true."""

    def __init__(self, token_ids: list[int]):
        super().__init__(f"cancelled after {len(token_ids)} sampled tokens")
        self.token_ids = token_ids  # what it had sampled by then


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


class VLLMServerSettings(Settings):
    """Where the vLLM engine's server runs (section vllm): none of it shapes what it samples, which
    depends on the policy, the sampling settings and vLLM's version (EngineSettings.version)."""

    python: str | None = read("vllm.python", placement=True)
    url: str | None = read("vllm.url", placement=True)
    weight_update: str = read("vllm.weight_update", placement=True)
    tensor_parallel_size: int = read("vllm.tensor_parallel_size", placement=True)
    data_parallel_size: int = read("vllm.data_parallel_size", placement=True)
    gpu_memory_utilization: float = read("vllm.gpu_memory_utilization", placement=True)
    extra_args: list[str] = read("vllm.extra_args", placement=True)
    start_timeout_s: float = read("vllm.start_timeout_s", placement=True)
    request_timeout_s: float = read("vllm.request_timeout_s", placement=True)


class EngineSettings(Settings):
    """What an engine reads: which engine, the policy's dtype and device, the sampling settings (a
    vLLM server is started with its logprob mode), the context it must take, the seed."""

    name: str = read("generation.engine")
    dtype: str = read("model.dtype")
    device: Device = read("model.device")
    temperature: float = read("generation.temperature")
    top_k: int = read("generation.top_k")
    top_p: float = read("generation.top_p")
    max_context_tokens: int = read("generation.max_context_tokens")
    kept_kv_mb: float = read("generation.kept_kv_mb", placement=True)  # the same bytes with any budget
    seed: int = read("seed")
    vllm: VLLMServerSettings
    runs_dir: str = read("store.runs_dir", placement=True)  # a vLLM server's log and checkpoint views
    rescore_tolerance: float | None = read("audit.tolerance", placement=True)  # a vLLM weight update's check

    @computed_field  # type: ignore[prop-decorator]
    @functools.cached_property
    def version(self) -> str | None:
        """An engine in its own environment: its library's version (vLLM), which shapes the numbers.
        None for the in-process engine, whose libraries are the shaping libraries every version hashes."""
        return vllm_version(self.vllm.python, self.vllm.url) if self.name == "vllm" else None

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)


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
        earlier_turns: Callable[[], datasets.Dataset] | None = None,
        report_progress: Callable[[float], None] | None = None,
    ) -> Generation:
        """A completion for every request. `earlier_turns` gives the rollouts' stored earlier turns
        (execute-tools rows), for an engine that must rebuild its state to continue exactly (it is
        called only then: reading a long episode's history costs time at every turn);
        `report_progress`, when given, is called with the share of the work done (0 to 1)."""
        ...

    def serve(
        self,
        take: Callable[[bool], Sequence[tuple[Any, Request]] | None],
        give: Callable[[Any, Completion | Exception], None],
        sampling: Sampling,
    ) -> None:
        """Serve requests as they arrive (the agents' endpoint): `take(idle)` returns the tagged requests
        waiting now, blocking for some when the engine is `idle` (serving none), or None to stop; each
        completion (or the exception that failed it) goes to `give(tag, ...)` as soon as it is done, not
        when the others are: a request never waits for another's completion to end. A request whose
        `cancelled()` becomes true is dropped as soon as the engine sees it, given back as CancelledRequestError."""
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


# name -> open(model_dir, tokenizer, settings): an engine serving that checkpoint
ENGINES: dict[str, Callable[[str | Path, Any, EngineSettings], GenerationEngine]] = {}


def open_engine(model_dir: str | Path, tokenizer: Any, settings: EngineSettings) -> GenerationEngine:
    if settings.name not in ENGINES:
        raise ValueError(f"unknown generation engine '{settings.name}'; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[settings.name](model_dir, tokenizer, settings)


class PolicyEngine:
    """The engine serving the current policy in this process, kept from turn to turn (it holds the
    rollouts' caches). When the next iteration's policy replaces it, an engine that reloads in place
    (a vLLM server's weight reload) loads the new checkpoint; any other is opened again on it."""

    def __init__(self) -> None:
        self.engine: GenerationEngine | None = None
        self.settings: EngineSettings | None = None
        self.model_dir: str | None = None

    def serving(self, model_dir: str | Path, tokenizer: Any, settings: EngineSettings) -> GenerationEngine:
        model_dir = str(model_dir)
        if self.engine is not None and self.settings == settings and self.model_dir != model_dir:
            if self.engine.reloads_in_place:
                self.engine.load_policy(model_dir)
                self.model_dir = model_dir
        if self.engine is None or (self.settings, self.model_dir) != (settings, model_dir):
            self.close()
            self.engine = open_engine(model_dir, tokenizer, settings)
            self.settings, self.model_dir = settings, model_dir
        return self.engine

    def close(self, unless_it_reloads: bool = False) -> None:
        """Close the open engine (a vLLM server mtrl started stops). After an iteration's turns an
        engine that would be reopened on the next policy anyway is closed at once, so that its
        memory (weights, KV cache) is free for the update."""
        if self.engine is not None and not (unless_it_reloads and self.engine.reloads_in_place):
            self.engine.close()
            self.engine = self.settings = self.model_dir = None


ENGINE = PolicyEngine()  # this process's: the flow's stage runs share it, the flow closes it
