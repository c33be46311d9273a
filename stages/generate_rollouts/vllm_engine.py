"""The vLLM engine: rollouts sampled by a vLLM server, token ids in and token ids out.

vLLM runs in its own Python environment (`vllm.python`: its CPU build cannot be installed
beside Prefect) as its OpenAI-compatible server, which mtrl starts on 127.0.0.1 for one policy
checkpoint, health-checks and stops at exit, with its log under the runs dir; or it is a server
the user runs elsewhere (`vllm.url`). Every request is one rollout turn: its whole token stream
as the prompt, its own seed, the sampled token ids and their logprobs back. Nothing is decoded
and re-tokenized, and vLLM's prefix cache reuses the rollout's earlier turns.

The logprob convention (engine.py) is after temperature, before top-k/top-p. The server started
here returns exactly that: `--logprobs-mode processed_logprobs` (after temperature and the
top-k/top-p mask) when top-k/top-p are off, `raw_logprobs` (no temperature, no mask) when they
are on with temperature 1; the config refuses the remaining combination. The audit's rescore
checks the stored logprobs against an HF recompute either way.

Weights: the policy changes every iteration. By default (`weight_update: in_place`) the running
server loads the new checkpoint: a server mtrl starts runs mtrl's worker extension
(vllm_extension/mtrl_vllm_extension.py: vLLM's reload, then the re-packing vLLM's CPU build
misses), a server at `vllm.url` vLLM's own `reload_weights`; then its prefix cache (the old
policy's KV) is reset. `restart` starts a new server on each checkpoint instead. Either way, every
policy the engine serves is verified before it generates: a probe's sampled tokens are re-scored
by an HF float32 forward of the checkpoint, and a logprob off by more than the audit's tolerance
fails the iteration (EngineError), never a silent fallback.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import datasets

from runtime.processes import free_port
from runtime.vllm_server import EngineError, VLLMServer, vllm_python, vllm_version
from schemas.features import FinishReason
from stages.generate_rollouts.engine import (
    ENGINES,
    CancelledRequestError,
    Completion,
    EngineSettings,
    Generation,
    Request,
    Sampling,
)
from stages.policy.loading import eos_token_ids, rescore_tolerance

SERVED_MODEL_NAME = "policy"
# mtrl's worker extension, imported by the servers mtrl starts (their PYTHONPATH holds its folder)
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_extension"
EXTENSION_CLASS = "mtrl_vllm_extension.CheckpointReload"
# The verification probe: PROBE_PROMPTS prompts of PROBE_PROMPT_TOKENS random token ids, each
# continued by PROBE_NEW_TOKENS sampled tokens whose logprobs an HF forward re-scores.
PROBE_PROMPTS, PROBE_PROMPT_TOKENS, PROBE_NEW_TOKENS = 2, 32, 16
FINISH_REASONS = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP}


def logprobs_mode(settings: EngineSettings) -> str:
    """The vLLM --logprobs-mode whose numbers are the stored convention (see the module docstring)."""
    return "processed_logprobs" if settings.top_k == 0 and settings.top_p == 1.0 else "raw_logprobs"


def served_checkpoint(model_dir: str | Path, runs_dir: str | Path) -> Path:
    """A folder of links to the checkpoint's model files only. vLLM loads every *.safetensors of a
    folder that has no index, and a stored policy also keeps its training state there (AdamW
    moments, the value head), which vLLM would try to load as weights."""
    model_dir = Path(model_dir).resolve()
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:12]
    view = Path(runs_dir).resolve() / ".vllm" / f"{model_dir.name}-{key}"
    if not view.is_dir():
        staging = view.with_name(f"{view.name}.tmp-{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        for path in model_dir.iterdir():
            if path.suffix != ".safetensors" or path.name.startswith("model"):
                (staging / path.name).symlink_to(path)
        try:
            staging.rename(view)  # atomic: a view is whole or absent
        except OSError:  # another process made it first
            shutil.rmtree(staging)
    return view


def server_command(model_dir: str | Path, settings: EngineSettings, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a vLLM server for this checkpoint: what shapes its
    numbers (dtype, seed, logprob mode, CPU scheduling) and mtrl's worker extension."""
    server = settings.vllm
    command = [
        vllm_python(server.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(served_checkpoint(model_dir, settings.runs_dir)),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_context_tokens),
        "--logprobs-mode", logprobs_mode(settings),
        "--enable-prefix-caching",
        "--generation-config", "vllm",  # vLLM's neutral defaults, not the checkpoint's sampling settings
        "--seed", str(settings.seed),
        "--tensor-parallel-size", str(server.tensor_parallel_size),
        "--data-parallel-size", str(server.data_parallel_size),
        "--gpu-memory-utilization", str(server.gpu_memory_utilization),
        "--worker-extension-cls", EXTENSION_CLASS,
    ]  # fmt: skip
    if settings.device == "cpu":
        command.append("--enforce-eager")  # CUDA graphs and torch.compile do not apply on CPU
        # A prompt split over scheduler steps (chunked prefill) rewinds its seeded generator, which
        # CPU generators cannot do: the engine dies ("CPU Generator does not use offset"). Whole
        # prompts only; the step's token budget must then hold the longest one.
        budget = max(settings.max_context_tokens, 8192)
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
    command += server.extra_args
    python_path = os.pathsep.join(filter(None, [str(EXTENSION_DIR), os.environ.get("PYTHONPATH")]))
    environment = {
        **os.environ,
        "PYTHONPATH": python_path,
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache, for in-place updates
        "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
    }
    return command, environment


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    """POST `body` as JSON; the JSON answer. Every way the exchange can fail is an OSError (HTTP errors
    included), so a server that dies mid-answer is one: http.client's IncompleteRead is not an OSError."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read()
    except http.client.HTTPException as exc:  # a cut or malformed answer
        raise ConnectionError(f"the answer broke off ({type(exc).__name__}: {exc})") from exc
    return json.loads(text) if text else None


class VLLMEngine:
    """The engine protocol (engine.py) over a vLLM server: one HTTP request per rollout turn, all
    of a turn's requests in flight at once so that vLLM batches them."""

    def __init__(
        self,
        url: str,
        eos_ids: Sequence[int],
        max_model_len: int,
        engine: EngineSettings,
        server: VLLMServer | None = None,
    ):
        self.url = url.rstrip("/")
        self.eos_ids = list(eos_ids)
        self.max_model_len = max_model_len
        self.settings = engine.vllm
        self.server = server
        self.log = str(server.log_path) if server else f"the log of the server at {self.url}"
        self.runs_dir = engine.runs_dir
        self.reloads_in_place = self.settings.weight_update == "in_place"
        self.logprobs_mode = logprobs_mode(engine)
        self.temperature = engine.temperature
        self.device = engine.device
        self.tolerance = rescore_tolerance(engine.rescore_tolerance, engine.dtype)
        self.update: dict[str, Any] = {}  # how the served policy (folder name) got there (provenance)

    @classmethod
    def open(cls, model_dir: str | Path, tokenizer: Any, settings: EngineSettings) -> VLLMEngine:
        from transformers import AutoConfig, GenerationConfig

        model_config = AutoConfig.from_pretrained(model_dir)
        try:
            generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:  # no generation_config.json
            generation_config = GenerationConfig.from_model_config(model_config)
        eos_ids = eos_token_ids(tokenizer, generation_config)
        max_model_len = getattr(model_config, "max_position_embeddings", None) or 10**9
        if settings.vllm.url:
            engine = cls(settings.vllm.url, eos_ids, max_model_len, settings)
            engine.load_policy(model_dir)  # whatever it served before
            return engine
        log_path = Path(settings.runs_dir) / "logs" / f"vllm-{Path(model_dir).name}.log"
        started = time.perf_counter()
        port = free_port()
        command, environment = server_command(model_dir, settings, port)
        server = VLLMServer(command, environment, f"http://127.0.0.1:{port}", log_path, settings.vllm.start_timeout_s)
        engine = cls(server.url, eos_ids, max_model_len, settings, server)
        engine.update = {
            "policy": Path(model_dir).name,
            "how": "server start",
            "seconds": round(time.perf_counter() - started, 4),
        }
        engine.verify(model_dir)
        return engine

    def describe(self) -> dict[str, Any]:
        return {
            "name": "vllm",
            "version": vllm_version(self.settings.python, self.settings.url),
            "server": "started by mtrl" if self.server else self.url,
            "weight_update": self.settings.weight_update,
            # how this policy reached the server, how long it took, and its verification
            "policy_update": self.update,
            # a server at vllm.url returns what its operator started it with
            "logprobs_mode": self.logprobs_mode if self.server else "as configured on the server (the audit checks it)",
        }

    def load_policy(self, model_dir: str | Path) -> None:
        """Load this checkpoint into the running server (weight_update in_place), reset its prefix
        cache, and verify the result before anything generates with it."""
        weights = str(served_checkpoint(model_dir, self.runs_dir))
        # mtrl's worker extension on a server mtrl started; vLLM's own reload on another
        method = "reload_checkpoint" if self.server else "reload_weights"
        started = time.perf_counter()
        try:
            post_json(
                f"{self.url}/collective_rpc",
                {"method": method, "kwargs": {"weights_path": weights}},
                self.settings.request_timeout_s,
            )
            reset = post_json(f"{self.url}/reset_prefix_cache", {}, self.settings.request_timeout_s)
        except OSError as exc:  # HTTP errors included
            raise EngineError(
                f"the vLLM server at {self.url} did not load {model_dir} in place ({exc}); that needs a server "
                f"started with VLLM_SERVER_DEV_MODE=1; see {self.log}"
            ) from exc
        if not (reset or {}).get("success", False):  # refused while requests hold blocks: none should
            raise EngineError(f"the vLLM server at {self.url} did not reset its prefix cache after loading {model_dir}")
        self.update = {
            "policy": Path(model_dir).name,
            "how": f"in place ({method})",
            "seconds": round(time.perf_counter() - started, 4),
        }
        self.verify(model_dir)

    def verify(self, model_dir: str | Path) -> None:
        """Check that the server serves this checkpoint: sample a fixed probe, re-score its tokens
        with an HF float32 forward of the checkpoint, and fail on a difference over the tolerance."""
        import torch

        from stages.policy.loading import load_model

        started = time.perf_counter()
        model = load_model(model_dir, "float32", self.device)
        vocab_size = model.get_input_embeddings().weight.shape[0]
        random = torch.Generator().manual_seed(0)
        prompts = torch.randint(vocab_size, (PROBE_PROMPTS, PROBE_PROMPT_TOKENS), generator=random).tolist()
        probe = [Request(i, ids, seed=i, max_new_tokens=PROBE_NEW_TOKENS) for i, ids in enumerate(prompts)]
        worst = 0.0
        for request, completion in zip(probe, self.generate(probe, Sampling(self.temperature)).completions):
            stream = torch.tensor([request.token_ids + completion.token_ids], device=model.device)
            with torch.no_grad():
                logits = model(stream).logits[0, len(request.token_ids) - 1 : -1].float() / self.temperature
            rescored = logits.log_softmax(-1).gather(-1, stream[0, len(request.token_ids) :, None])[:, 0]
            difference = (rescored.cpu() - torch.tensor(completion.logprobs)).abs().max()
            worst = max(worst, float(difference))
        self.update |= {"verify_seconds": round(time.perf_counter() - started, 4), "probe_max_abs_diff": worst}
        if not worst <= self.tolerance:  # NaN fails too
            raise EngineError(
                f"the vLLM server at {self.url} does not serve {model_dir} after its weight update "
                f"({self.update['how']}): a probe's logprobs differ from an HF float32 recompute by up to {worst:.3g} "
                f"(tolerance {self.tolerance:g}); no rollout was generated with it. See {self.log}"
            )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def generate(
        self,
        requests: Sequence[Request],
        sampling: Sampling,
        earlier_turns: Callable[[], datasets.Dataset] | None = None,
        report_progress: Callable[[float], None] | None = None,
    ) -> Generation:
        """A completion per request. `earlier_turns` are not needed: every request carries its
        rollout's whole stream, and the server's prefix cache finds what it already computed."""
        completions: list[Completion | None] = [None] * len(requests)
        if not requests:
            return Generation([])
        with ThreadPoolExecutor(max_workers=min(len(requests), 256)) as pool:
            futures = {pool.submit(self.complete, request, sampling): i for i, request in enumerate(requests)}
            for done, future in enumerate(as_completed(futures), start=1):
                completions[futures[future]] = future.result()
                if report_progress is not None:
                    report_progress(done / len(requests))
        return Generation(completions)

    def serve(
        self,
        take: Callable[[bool], Sequence[tuple[Any, Request]] | None],
        give: Callable[[Any, Completion | Exception], None],
        sampling: Sampling,
    ) -> None:
        """Each request is sent as it arrives: the server batches them continuously itself. One cancelled
        before it is sent is dropped; one already sent runs to its end (its reply is then dropped)."""

        def answer(tag: Any, request: Request) -> None:
            if request.cancelled():
                give(tag, CancelledRequestError([]))
                return
            try:
                outcome: Completion | Exception = self.complete(request, sampling)
            except Exception as exc:  # this request fails, not the others
                outcome = exc
            give(tag, outcome)

        with ThreadPoolExecutor(max_workers=256) as pool:
            while (arrived := take(True)) is not None:
                for tag, request in arrived:
                    pool.submit(answer, tag, request)

    def complete(self, request: Request, sampling: Sampling) -> Completion:
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": request.token_ids,
            "max_tokens": request.max_new_tokens,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": request.seed,
            "logprobs": 0,  # the sampled token's logprob
            "return_token_ids": True,
            "stop": list(request.stop),
            "include_stop_str_in_output": True,
            "stop_token_ids": self.eos_ids,  # mtrl's EOS set, the only tokens that end a turn:
            "ignore_eos": True,  # vLLM's own EOS notion (the tokenizer's) is not consulted
            "skip_special_tokens": False,
        }
        try:
            choice = post_json(f"{self.url}/v1/completions", body, self.settings.request_timeout_s)["choices"][0]
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EngineError(f"the vLLM server refused a request ({exc.code}): {detail}; see {self.log}") from exc
        except OSError as exc:
            ended = (self.server.died(wait_s=5.0) if self.server else None) or "it stopped answering"
            raise EngineError(
                f"the vLLM server at {self.url} failed mid-turn ({ended}: {exc}); see {self.log}"
            ) from exc
        token_ids = choice["token_ids"]
        logprobs = choice["logprobs"]["token_logprobs"]
        finish = FINISH_REASONS[choice["finish_reason"]]
        if finish == FinishReason.STOP and isinstance(choice.get("stop_reason"), str):
            finish = FinishReason.STOP_STRING
        return Completion(token_ids, [float(x) for x in logprobs], finish)


ENGINES["vllm"] = VLLMEngine.open
