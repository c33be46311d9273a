"""The agents' endpoint over HTTP: an ASGI app (Starlette) that uvicorn serves in a thread of its own,
with its own event loop. Real clients keep connections alive, retry, send odd bodies and go away
mid-call: every refusal is a JSON error {"error": {"message", "type", "param", "code"}} on a
connection that stays usable, and a client that goes away stops its call's sampling.

Starlette, not FastAPI: the endpoint reads and validates its bodies itself (it counts their bytes
before parsing them, refuses with OpenAI's error shape and a 400 that names the field as the body
spells it), which FastAPI's body injection would do its own way (a 422 in its own shape, after
reading the whole body); its OpenAPI schema would serve nobody. Starlette is the part of FastAPI
used here: routing, requests and responses.

Refusals, in the order they are checked:
    401  no `Authorization: Bearer KEY` with the run's key (checked first: KeyCheck)
    404  an unknown rollout or route; 405 a route asked with another method
    413  a body over MAX_BODY_BYTES
    400  a body that is not a JSON object of the route's shape (protocol.py), or a call mtrl cannot
         serve (over the context budget, a chat template that cannot render it, past the call limit)
    409  a call of a rollout that has failed
    500  the engine failed
A 401, 404 or 405 changes nothing: without the key no process can fail a rollout, nor learn which
exist. The others fail the rollout the request names (its agent's own client sent what mtrl cannot
record), except the call past the limit, which ends the rollout cut at it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from stages.generate_rollouts.agents import openai_api
from stages.generate_rollouts.agents.protocol import ChatRequest, GenerateRequest, ResponsesRequest, refusal
from stages.generate_rollouts.agents.record import Call, RequestError, RolloutRecord
from stages.generate_rollouts.agents.scheduler import Scheduler

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)


class Served(Protocol):
    """What the app serves (endpoint.py's Endpoint): the iteration's rollouts, the scheduler that has the
    engine sample their calls, and what the replies name."""

    records: dict[int, RolloutRecord]
    scheduler: Scheduler
    tokenizer: Any
    model: str
    max_context_tokens: int
    api_key: str


# The largest body read. A call's context is at most generation.max_context_tokens (a 128k-token context
# is ~0.5 MiB of text), so 32 MiB holds any history with room for verbose JSON and tool results, while
# a runaway client cannot make the endpoint hold gigabytes.
MAX_BODY_BYTES = 32 * 2**20
# A kept-alive connection's idle time before the server closes it: longer than any client's (httpx, under
# the openai client, drops idle connections after 5 s), so a client never sends on a socket the server
# has just closed (servers that keep 5 s see ECONNRESET errors).
KEEP_ALIVE_S = 75
# Pending connections the kernel holds before the event loop accepts them: every agent's first call
# arrives at once (a backlog of 5 dropped most of 64 agents' first SYNs, retried by their kernels 1 s later).
BACKLOG = socket.SOMAXCONN
CLIENT_LEFT = 499  # the status of a reply nobody reads (nginx's "client closed request")
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error"}


class JSONReply(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def refused(error: RequestError) -> Response:
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    payload = {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.status}}
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONReply(payload, status_code=error.status, headers=headers)


class KeyCheck:
    """The run's key, checked before routing, body reading or any rollout lookup: a request without it
    gets a 401 and changes nothing. Digests are compared in constant time (hmac.compare_digest), so the
    time a refusal takes says nothing about the key."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(hashlib.sha256(given).digest(), self.expected):
                error = RequestError("wrong or missing API key (Authorization: Bearer KEY)", 401)
                await refused(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def app(endpoint: Served) -> Starlette:
    """The endpoint's routes, each under a rollout's path and at the root (the rollout named by an
    X-Session-ID header), behind the key check."""
    handlers = Handlers(endpoint)
    served = [
        ("GET", "/v1/models", handlers.models),
        ("POST", "/v1/chat/completions", handlers.chat),
        ("POST", "/v1/responses", handlers.responses),
        ("POST", "/inference/v1/generate", handlers.generate),
    ]
    routes = [
        Route(prefix + path, handler, methods=[method])
        for method, path, handler in served
        for prefix in ("/rollouts/{rollout_id}", "")
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(KeyCheck, api_key=endpoint.api_key)],
        exception_handlers={HTTPException: _unrouted},
    )


async def _unrouted(request: Request, exc: Exception) -> Response:
    """A path or method no route serves (Starlette's 404 and 405), as a JSON error."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    if status == 404:
        message = f"unknown route {request.method} {request.url.path}: use the base URL mtrl gave the rollout"
    else:
        message = f"{request.method} is not served on {request.url.path}"
    return refused(RequestError(message, status))


class Handlers:
    """The routes' handlers: each finds the rollout, reads the body, has the scheduler answer the call and
    returns it in the route's wire format."""

    def __init__(self, endpoint: Served):
        self.endpoint = endpoint

    async def models(self, request: Request) -> Response:
        try:
            self._record(request)
        except RequestError as error:
            return refused(error)
        model = {"id": self.endpoint.model, "object": "model", "owned_by": "mtrl"}
        return JSONReply({"object": "list", "data": [{**model, "max_model_len": self.endpoint.max_context_tokens}]})

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self._chat)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, self._responses)

    async def generate(self, request: Request) -> Response:
        return await self._serve(request, self._generate)

    def _record(self, request: Request) -> RolloutRecord:
        """The rollout a request names, by its path or its X-Session-ID header (404 if none)."""
        rollout = request.path_params.get("rollout_id") or request.headers.get("x-session-id")
        if rollout is None:
            path = request.url.path
            raise RequestError(f"{path} names no rollout: use the base URL mtrl gave it (or X-Session-ID)", 404)
        record = self.endpoint.records.get(int(rollout)) if rollout.isdecimal() else None
        if record is None:
            raise RequestError(f"no rollout {rollout} in this iteration", 404)
        return record

    async def _serve(
        self,
        request: Request,
        serve: Callable[[Request, RolloutRecord, dict[str, Any]], Awaitable[Response]],
    ) -> Response:
        """A POST for a rollout: an unknown rollout changes nothing; a request of a known one that cannot be
        served fails it; a client that went away is only logged."""
        try:
            record = self._record(request)
        except RequestError as error:
            return refused(error)
        try:
            return await serve(request, record, await _json_body(request))
        except ClientDisconnect:
            log.debug("rollout %s: the client went away while sending its request", record.start["rollout_id"])
            return Response(status_code=CLIENT_LEFT)
        except RequestError as error:
            record.fail(f"request refused ({error.status}): {error}")
            return refused(error)
        except Exception as exc:  # mtrl's own bug: the rollout fails, the connection stays usable
            log.exception("the agents' endpoint failed on a request of rollout %s", record.start["rollout_id"])
            error = RequestError(f"the endpoint failed: {exc.__class__.__name__}: {exc}", 500)
            record.fail(f"request refused ({error.status}): {error}")
            return refused(error)

    async def _answer(
        self,
        request: Request,
        record: RolloutRecord,
        body: dict[str, Any],
        asked: dict[str, Any],
        max_tokens: int | None,
        stop: tuple[str, ...] = (),
    ) -> Call | None:
        """The answered call, or None if the client went away first (then its call is dropped). The
        openai client marks its first attempt `x-stainless-retry-count: 0`: that is a new call even when
        it repeats an earlier body (an agent may ask the same twice on purpose)."""
        first_attempt = request.headers.get("x-stainless-retry-count") == "0"
        scheduler = self.endpoint.scheduler
        call, answered = scheduler.submit(record, body, asked, max_tokens, stop, first_attempt)
        if answered is not None:  # not answered yet: until it is, or until the client goes away
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({answered, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not answered.done():
                scheduler.leave(record, call, answered)
                return None
            gone.cancel()
        if call.error is not None:
            raise call.error
        return call

    async def _chat(self, request: Request, record: RolloutRecord, body: dict[str, Any]) -> Response:
        asked = _validated(ChatRequest, body)
        messages, tools = openai_api.chat_request(body)
        sampled = {"messages": messages, "tools": tools}
        call = await self._answer(request, record, body, sampled, asked.max_new_tokens, asked.stop)
        if call is None:
            return Response(status_code=CLIENT_LEFT)
        model, request_id = self.endpoint.model, f"chatcmpl-{record.start['rollout_id']}-{call.index}"
        if not asked.stream:
            logprobs = bool(asked.logprobs)
            return JSONReply(openai_api.chat_completion(call, model, request_id, self.endpoint.tokenizer, logprobs))
        include_usage = bool(asked.stream_options and asked.stream_options.include_usage)
        return _events(openai_api.sse(openai_api.chat_chunks(call, model, request_id, include_usage)))

    async def _responses(self, request: Request, record: RolloutRecord, body: dict[str, Any]) -> Response:
        asked = _validated(ResponsesRequest, body)
        messages, tools = openai_api.responses_request(body)
        call = await self._answer(
            request, record, body, {"messages": messages, "tools": tools}, asked.max_output_tokens
        )
        if call is None:
            return Response(status_code=CLIENT_LEFT)
        answer = openai_api.response(call, self.endpoint.model, f"resp_{record.start['rollout_id']}_{call.index}", body)
        return _events(openai_api.response_events(answer)) if asked.stream else JSONReply(answer)

    async def _generate(self, request: Request, record: RolloutRecord, body: dict[str, Any]) -> Response:
        """Token ids in, token ids out (verifiers' train client, as prime-rl serves it)."""
        asked = _validated(GenerateRequest, body)
        vocabulary = len(self.endpoint.tokenizer)
        if any(not 0 <= token < vocabulary for token in asked.token_ids):
            raise RequestError(f"holds ids outside the vocabulary (0..{vocabulary - 1})", param="token_ids")
        sampling = asked.sampling_params
        token_ids = {"token_ids": asked.token_ids}
        call = await self._answer(request, record, body, token_ids, sampling.max_tokens, sampling.stop)
        if call is None:
            return Response(status_code=CLIENT_LEFT)
        return JSONReply(openai_api.generated(call, f"gen-{record.start['rollout_id']}-{call.index}"))


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, read up to MAX_BODY_BYTES (a declared length over it is refused
    before reading; a chunked body is counted as it comes)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"the body's {declared} bytes are over the limit of {MAX_BODY_BYTES} bytes", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"the body is over the limit of {MAX_BODY_BYTES} bytes", 413)
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise RequestError("the body must be a JSON object")
    return parsed


def _validated(model: type[Model], body: dict[str, Any]) -> Model:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise refusal(error, body) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (its body read, nothing but the disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _events(pieces: Iterator[bytes]) -> Response:
    """Server-sent events, all at once: the whole reply is sampled before its first byte goes out."""
    return Response(b"".join(pieces), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class HttpServer:
    """uvicorn serving an app in a thread of its own, with its own event loop, on a socket bound here
    (its port is known before it serves)."""

    def __init__(self, asgi: ASGIApp, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Named TCP, asyncio's event loop sets TCP_NODELAY on each connection (uvloop does anyway): with
        # Nagle's algorithm, a reply's headers and body in two writes took 44 ms a round trip, not 1.
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, 0))
        self.socket.listen(BACKLOG)
        config = uvicorn.Config(
            asgi,
            lifespan="off",
            ws="none",
            backlog=BACKLOG,  # uvicorn listens on the socket again, with its own backlog
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=5,
            access_log=False,  # a line per call would drown the run's log
            log_config=None,  # the process's logging stays as it is
            # uvicorn's own loggers at warning: no start and stop lines (a client that goes away is never
            # logged by uvicorn; here at debug)
            log_level="warning",
            server_header=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="mtrl-agent-http", daemon=True
        )

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    def start(self) -> None:
        self.thread.start()
        while not self.server.started:  # a few ms: its event loop is up and the socket accepted on
            if not self.thread.is_alive():
                raise RuntimeError("the agents' endpoint did not start (see the log above)")
            time.sleep(0.005)

    def stop(self) -> None:
        """Close the connections (their requests answered first) and the socket."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join()
        self.socket.close()
