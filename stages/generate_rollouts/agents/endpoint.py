"""The OpenAI-compatible endpoint mtrl serves while agents run (by default on 127.0.0.1).

    GET  /rollouts/{id}/v1/models                 the policy, with max_model_len
    POST /rollouts/{id}/v1/chat/completions       streamed or not; tool calls parsed from the model's text
    POST /rollouts/{id}/v1/responses              the Responses API, streamed or not
    POST /rollouts/{id}/inference/v1/generate     token ids in and out (verifiers' train client)

A rollout is known by its path (or, at the server's root, by an X-Session-ID header holding its id)
and the run's secret key (Authorization: Bearer KEY). Its parts: the request shapes (protocol.py)
and their OpenAI wire formats (openai_api.py), the HTTP server (server.py: an ASGI app on uvicorn,
its refusals), and the scheduler of the calls (scheduler.py: the engine's thread, retries, dropped
calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stages.generate_rollouts.agents.record import RolloutRecord
from stages.generate_rollouts.agents.scheduler import Scheduler
from stages.generate_rollouts.agents.server import HttpServer, app
from stages.generate_rollouts.engine import GenerationEngine, Sampling


class Endpoint:
    """The records of one iteration's agent rollouts, the scheduler that has the engine sample their
    calls, and the HTTP server in front of them; serving inside `with endpoint:`."""

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
        host: str = "127.0.0.1",
    ):
        self.tokenizer, self.records, self.model, self.api_key = tokenizer, records, model, api_key
        self.max_context_tokens, self.host = max_context_tokens, host
        self.scheduler = Scheduler(
            engine,
            tokenizer,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            max_context_tokens=max_context_tokens,
            enable_thinking=enable_thinking,
            seed_of=seed_of,
        )
        self.http = HttpServer(app(self), host)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http.port}"

    @property
    def running(self) -> set[int]:
        """The rollouts whose agents have not returned (the scheduler waits for their calls)."""
        return self.scheduler.running

    @running.setter
    def running(self, rollout_ids: set[int]) -> None:
        self.scheduler.running = rollout_ids

    def agent_returned(self, rollout_id: int) -> None:
        self.scheduler.agent_returned(rollout_id)

    def __enter__(self) -> Endpoint:
        self.scheduler.start()
        try:
            self.http.start()
        except BaseException:
            self.scheduler.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.scheduler.stop()  # the calls still waiting are answered (the endpoint stopped) ...
        self.http.stop()  # ... before the server closes their connections
