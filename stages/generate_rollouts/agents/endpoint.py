"""The OpenAI-compatible endpoint mtrl serves on 127.0.0.1 while agents run.

    GET  /rollouts/{id}/v1/models                 the policy, with max_model_len
    POST /rollouts/{id}/v1/chat/completions       streamed or not; tool calls parsed from the model's text
    POST /rollouts/{id}/v1/responses              the Responses API, streamed or not
    POST /rollouts/{id}/inference/v1/generate     token ids in and out (verifiers' train client)

A rollout is known by its path (or, at the server's root, by an X-Session-ID header holding its
id) and the run's secret key (Authorization: Bearer KEY). Requests that
wait at one moment go to the engine as one batch (the sampler thread); each call is sampled with
its own seed (rollout, call), so a deterministic agent gets the same tokens whatever else is in the
batch. A retried identical request is answered from the record, never sampled twice. A request
mtrl cannot serve gets a 4xx JSON error that says why, and fails its rollout only.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stages.generate_rollouts.agents import openai_api
from stages.generate_rollouts.agents.record import Call, RequestError, RolloutRecord, next_call, reply_of
from stages.generate_rollouts.engine import Completion, GenerationEngine, Request, Sampling

# When the engine is idle and a call arrives, the sampler waits for the other agents' calls while they
# keep coming: until every running agent has called, or none came for GATHER_S, or GATHER_MAX_S passed.
# While the engine decodes, calls join its batch at its next step (engine.serve).
GATHER_S = 0.03
GATHER_MAX_S = 0.1
_PATH = re.compile(r"^/rollouts/(\d+)(/.*)$")


class Endpoint:
    """The records of one iteration's agent rollouts, the sampler that serves their calls, and the
    HTTP server in front of them."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        records: dict[int, RolloutRecord],
        *,
        sampling: Sampling,
        max_new_tokens: int,
        max_context_tokens: int,
        enable_thinking: bool,
        seed_of: Callable[[int, int], int],
        model: str,
        api_key: str,
    ):
        self.engine, self.tokenizer, self.records = engine, tokenizer, records
        self.sampling, self.max_new_tokens, self.max_context_tokens = sampling, max_new_tokens, max_context_tokens
        self.enable_thinking, self.seed_of, self.model, self.api_key = enable_thinking, seed_of, model, api_key
        self.waiting: list[tuple[RolloutRecord, Call, int]] = []  # calls not yet taken by the engine
        self.in_flight: dict[int, tuple[RolloutRecord, Call]] = {}  # calls the engine holds, by id
        self.running: set[int] = set()  # rollouts whose agents have not returned
        self.arrived = threading.Condition()
        self.stopped = False
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.threads = [
            threading.Thread(target=self.server.serve_forever, name="mtrl-agent-http", daemon=True),
            threading.Thread(target=self._sample_forever, name="mtrl-agent-sampler", daemon=True),
        ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Endpoint:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.arrived:
            self.stopped = True
            self.arrived.notify_all()
        self.server.shutdown()
        self.server.server_close()
        for thread in self.threads:
            thread.join()

    def agent_returned(self, rollout_id: int) -> None:
        with self.arrived:
            self.running.discard(rollout_id)
            self.arrived.notify_all()

    # ------------------------------------------------------------------ the calls

    def call(self, record: RolloutRecord, digest: str, request: dict[str, Any], max_tokens: int | None) -> Call:
        """The call for this request (record.next_call's), the recorded one for a retry, else a new one,
        sampled with at most `max_tokens` new tokens."""
        with record.lock:
            if record.failure is not None:
                raise RequestError(f"rollout {record.start['rollout_id']} has failed: {record.failure}", 409)
            if digest in record.answered:
                call = record.answered[digest]
            else:
                if len(record.calls) >= record.call_limit:
                    record.cut = True
                    raise RequestError(f"the rollout reached its limit of {record.call_limit} model calls")
                rollout_id = record.start["rollout_id"]
                seed = self.seed_of(rollout_id, len(record.calls))
                call = next_call(record, self.tokenizer, request, self.enable_thinking, seed)
                budget = min(
                    max_tokens or self.max_new_tokens, self.max_new_tokens, self.max_context_tokens - len(call.stream)
                )
                if budget < 1:
                    raise RequestError(
                        f"the context holds {len(call.stream)} tokens: over the budget of "
                        f"{self.max_context_tokens} (generation.max_context_tokens)"
                    )
                record.calls.append(call)
                record.answered[digest] = call
                with self.arrived:
                    self.waiting.append((record, call, budget))
                    self.arrived.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call

    def _take(self, idle: bool) -> list[tuple[tuple[RolloutRecord, Call], Request]] | None:
        """The engine's next requests: the calls waiting now, or None once the endpoint stops. When the
        engine is `idle`, wait for a call, then for the other agents' calls while they keep coming
        (their tools are fast: they arrive together, and a group's prompts are prefilled once)."""
        with self.arrived:
            if idle:
                while not self.waiting and not self.stopped:
                    self.arrived.wait()
                first = time.monotonic()
                while not self.stopped and len(self.waiting) < len(self.running):
                    seen = len(self.waiting)
                    quiet_until = min(time.monotonic() + GATHER_S, first + GATHER_MAX_S)
                    while len(self.waiting) == seen and not self.stopped and time.monotonic() < quiet_until:
                        self.arrived.wait(quiet_until - time.monotonic())
                    if len(self.waiting) == seen:  # none came for GATHER_S, or GATHER_MAX_S passed
                        break
            if self.stopped:
                return None
            taken, self.waiting = self.waiting, []
            self.in_flight.update((id(call), (record, call)) for record, call, _ in taken)
        return [
            ((record, call), Request(record.start["rollout_id"], call.stream, call.seed, budget))
            for record, call, budget in taken
        ]

    def _give(self, tag: tuple[RolloutRecord, Call], outcome: Completion | Exception) -> None:
        """A call's completion (or the engine's failure) goes back to the request waiting for it."""
        record, call = tag
        if isinstance(outcome, Exception):
            call.error = RequestError(f"the engine failed: {outcome.__class__.__name__}: {outcome}", 500)
        else:
            call.completion, call.logprobs, call.finish_reason = (
                outcome.token_ids,
                outcome.logprobs,
                outcome.finish_reason,
            )
            reply_of(call, self.tokenizer, record.start["rollout_id"])
        with self.arrived:
            self.in_flight.pop(id(call), None)
        call.done.set()

    def _sample_forever(self) -> None:
        """The engine serves the calls as they come (continuous batching where it has it); if it fails, the
        calls it held fail (a 500) and it serves on."""
        while not self.stopped:
            try:
                self.engine.serve(self._take, self._give, self.sampling)
            except Exception as exc:
                with self.arrived:
                    failed = list(self.in_flight.values())
                for tag in failed:
                    self._give(tag, exc)
        with self.arrived:
            left = list(self.in_flight.values()) + [(record, call) for record, call, _ in self.waiting]
        for tag in left:  # the run is over before they were answered
            self._give(tag, RuntimeError("the endpoint stopped"))


class _Server(ThreadingHTTPServer):
    # The listen backlog: socketserver's default of 5 pending connections dropped the SYNs of most of 64
    # agents' first calls, which the clients' kernels sent again 1 s later (bench/agents.py: the first
    # calls came in waves at 0, 1.0 and 1.4 s).
    request_queue_size = socket.SOMAXCONN


def _digest(body: dict[str, Any]) -> str:
    """What makes two requests the same call: the body, streamed or not."""
    asked = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body go out as separate writes: with Nagle's algorithm a client that waits for the
        # body before acking saw 44 ms per round trip instead of 0.8 ms (bench/agents.py)
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            pass  # one line per request would drown the run's log

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, error: RequestError) -> None:
            kind = "invalid_request_error" if error.status < 500 else "server_error"
            self._send(error.status, {"error": {"message": str(error), "type": kind, "code": error.status}})

        def _record(self) -> tuple[RolloutRecord, str]:
            path = self.path.split("?", 1)[0]
            match = _PATH.match(path)
            rollout, route = (match.group(1), match.group(2)) if match else (self.headers.get("X-Session-ID"), path)
            if rollout is None:
                raise RequestError(f"unknown path {path}: use the base URL mtrl gave the rollout", 404)
            record = endpoint.records.get(int(rollout)) if rollout.isdigit() else None
            if record is None:
                raise RequestError(f"no rollout {rollout} in this iteration", 404)
            return record, route

        def _check_key(self) -> None:
            if self.headers.get("Authorization", "") != f"Bearer {endpoint.api_key}":
                raise RequestError("wrong or missing API key (Authorization: Bearer KEY)", 401)

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            try:
                _, route = self._record()
                self._check_key()
                if route.rstrip("/") != "/v1/models":
                    raise RequestError(f"unknown route GET {route}", 404)
                model = {"id": endpoint.model, "object": "model", "owned_by": "mtrl"}
                self._send(200, {"object": "list", "data": [{**model, "max_model_len": endpoint.max_context_tokens}]})
            except RequestError as error:
                self._error(error)

        def do_POST(self) -> None:  # noqa: N802
            record = None
            try:
                record, route = self._record()
                self._check_key()
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                except ValueError as exc:
                    raise RequestError(f"the body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                if route == "/v1/chat/completions":
                    self._chat(record, body)
                elif route == "/v1/responses":
                    self._responses(record, body)
                elif route == "/inference/v1/generate":
                    self._generate(record, body)
                else:
                    raise RequestError(f"unknown route POST {route}", 404)
            except RequestError as error:
                if record is not None and error.status != 404:
                    record.fail(f"request refused ({error.status}): {error}")
                self._error(error)

        def _chat(self, record: RolloutRecord, body: dict[str, Any]) -> None:
            if (body.get("n") or 1) > 1:
                raise RequestError("n > 1 is not served: each rollout samples one completion per call")
            messages, tools = openai_api.chat_request(body)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            call = endpoint.call(record, _digest(body), {"messages": messages, "tools": tools}, max_tokens)
            request_id = f"chatcmpl-{record.start['rollout_id']}-{call.index}"
            if not body.get("stream"):
                completion = openai_api.chat_completion(
                    call, endpoint.model, request_id, endpoint.tokenizer, bool(body.get("logprobs"))
                )
                self._send(200, completion)
                return
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(openai_api.sse(openai_api.chat_chunks(call, endpoint.model, request_id, include_usage)))

        def _responses(self, record: RolloutRecord, body: dict[str, Any]) -> None:
            messages, tools = openai_api.responses_request(body)
            request = {"messages": messages, "tools": tools}
            call = endpoint.call(record, _digest(body), request, body.get("max_output_tokens"))
            answer = openai_api.response(call, endpoint.model, f"resp_{record.start['rollout_id']}_{call.index}", body)
            if body.get("stream"):
                self._stream(openai_api.response_events(answer))
            else:
                self._send(200, answer)

        def _stream(self, pieces: Iterator[bytes]) -> None:
            """Server-sent events, chunked."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in pieces:
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

        def _generate(self, record: RolloutRecord, body: dict[str, Any]) -> None:
            """Token ids in, token ids out (verifiers' train client, as prime-rl serves it)."""
            token_ids = body.get("token_ids")
            if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
                raise RequestError("'token_ids' must be a non-empty list of integers")
            vocabulary = len(endpoint.tokenizer)
            if any(not 0 <= token < vocabulary for token in token_ids):
                raise RequestError(f"'token_ids' holds ids outside the vocabulary (0..{vocabulary - 1})")
            sampling = body.get("sampling_params") or {}
            if (sampling.get("n") or 1) > 1:
                raise RequestError("n > 1 is not served: each rollout samples one completion per call")
            call = endpoint.call(record, _digest(body), {"token_ids": token_ids}, sampling.get("max_tokens"))
            self._send(200, openai_api.generated(call, f"gen-{record.start['rollout_id']}-{call.index}"))

    return Handler
