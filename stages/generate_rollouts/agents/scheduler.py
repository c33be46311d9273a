"""The agents' calls between the endpoint's event loop and the engine: each request becomes its
rollout's next call (record.next_call), the engine samples the calls in a thread of its own
(engine.serve), and each answer goes back to the coroutines waiting for it (call_soon_threadsafe).
Nothing here speaks HTTP (server.py does).

Requests that wait at one moment go to the engine as one batch; each call is sampled with its own
seed (rollout, call index), so a deterministic agent gets the same tokens whatever else is in the
batch. A retried request is answered from the record, never sampled twice. A call nobody waits for
any more (its client went away) is dropped: the engine stops sampling it and it leaves the record,
so the client's retry is the same call again (same index, same seed, same tokens).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.features import FinishReason
from stages.generate_rollouts.agents.protocol import digest
from stages.generate_rollouts.agents.record import Call, RequestError, RolloutRecord, next_call, reply_of
from stages.generate_rollouts.engine import Completion, GenerationEngine, Request, Sampling

log = logging.getLogger(__name__)

# When the engine is idle and a call arrives, the sampler waits for the other agents' calls while they
# keep coming: until every running agent has called, or none came for GATHER_S, or GATHER_MAX_S passed.
# While the engine decodes, calls join its batch at its next step (engine.serve).
GATHER_S = 0.03
GATHER_MAX_S = 0.1


@dataclass(eq=False)
class Pending:
    """A call the engine has not answered yet, and the coroutines waiting for it."""

    record: RolloutRecord
    call: Call
    digest: str
    request: Request
    dropped: threading.Event  # nobody waits for it any more: the engine stops sampling it
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class Scheduler:
    """The calls of one iteration's agent rollouts and the thread in which the engine samples them."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        *,
        sampling: Sampling,
        max_new_tokens: int,
        max_context_tokens: int,
        enable_thinking: bool,
        seed_of: Callable[[int, int], int],
    ):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_new_tokens, self.max_context_tokens = max_new_tokens, max_context_tokens
        self.enable_thinking, self.seed_of = enable_thinking, seed_of
        # All below is guarded by `arrived` (a record's calls by its own lock, taken before it).
        self.arrived = threading.Condition()
        self.pending: dict[int, Pending] = {}  # id(call) -> its Pending, until answered or dropped
        self.waiting: list[Pending] = []  # not yet taken by the engine
        self.in_flight: set[Pending] = set()  # taken by the engine, not yet given back
        self.running: set[int] = set()  # rollouts whose agents have not returned
        self.stopped = False
        self.thread = threading.Thread(target=self._sample_forever, name="mtrl-agent-sampler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop sampling; the calls not answered yet fail (the endpoint stopped)."""
        with self.arrived:
            self.stopped = True
            self.arrived.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def agent_returned(self, rollout_id: int) -> None:
        with self.arrived:
            self.running.discard(rollout_id)
            self.arrived.notify_all()

    # ------------------------------------------------------------------ the event loop's side

    def submit(
        self,
        record: RolloutRecord,
        body: dict[str, Any],
        request: dict[str, Any],
        max_tokens: int | None,
        stop: tuple[str, ...],
        first_attempt: bool,
    ) -> tuple[Call, asyncio.Future[None] | None]:
        """The call that answers the request, and a future done when it is answered (None if it is):
        the recorded call of the same body (a retry; unless the client says this is its first attempt,
        a new request that happens to repeat an earlier one), else the record's next call, sampled
        with at most `max_tokens` new tokens and ended by the `stop` strings. Runs in the event loop."""
        key = digest(body)
        with record.lock:
            if record.failure is not None:
                raise RequestError(f"rollout {record.start['rollout_id']} has failed: {record.failure}", 409)
            call = None if first_attempt else record.answered.get(key)
            if call is None:
                call = self._new_call(record, key, request, max_tokens, stop)
            with self.arrived:
                if call.done.is_set():
                    return call, None
                answered = asyncio.get_running_loop().create_future()
                self.pending[id(call)].waiters.append(answered)
        return call, answered

    def _new_call(
        self, record: RolloutRecord, key: str, request: dict[str, Any], max_tokens: int | None, stop: tuple[str, ...]
    ) -> Call:
        """The record's next call, rendered and waiting for the engine (record.lock held)."""
        if len(record.calls) >= record.call_limit:
            record.cut = True
            raise RequestError(f"the rollout reached its limit of {record.call_limit} model calls")
        rollout_id = record.start["rollout_id"]
        call = next_call(
            record, self.tokenizer, request, self.enable_thinking, self.seed_of(rollout_id, len(record.calls))
        )
        budget = min(max_tokens or self.max_new_tokens, self.max_new_tokens, self.max_context_tokens - len(call.stream))
        if budget < 1:
            raise RequestError(
                f"the context holds {len(call.stream)} tokens: over the budget of "
                f"{self.max_context_tokens} (generation.max_context_tokens)"
            )
        record.calls.append(call)
        record.answered[key] = call
        dropped = threading.Event()
        engine_request = Request(rollout_id, call.stream, call.seed, budget, stop, cancelled=dropped.is_set)
        pending = Pending(record, call, key, engine_request, dropped)
        with self.arrived:
            self.pending[id(call)] = pending
            self.waiting.append(pending)
            self.arrived.notify_all()
        return call

    def leave(self, record: RolloutRecord, call: Call, answered: asyncio.Future[None]) -> None:
        """The waiter `answered` went away (its client did). A call nobody waits for, not answered yet, is
        dropped: the engine stops sampling it, and it leaves the record, so that a retry is the same call
        again. (Unless the rollout made a later call meanwhile: then it stays, failed, never a row, and a
        retry is a new call.)"""
        with record.lock:
            with self.arrived:
                pending = self.pending.get(id(call))
                if pending is None:  # answered meanwhile: a retry gets it from the record
                    return
                pending.waiters.remove(answered)
                if pending.waiters:
                    return
                del self.pending[id(call)]
                pending.dropped.set()
                if pending in self.waiting:
                    self.waiting.remove(pending)
            if record.calls[-1] is call:
                record.calls.pop()
            else:
                call.error = RequestError("its client went away before the answer", 499)
            if record.answered.get(pending.digest) is call:
                del record.answered[pending.digest]
        log.debug("rollout %s: call %d dropped, its client went away", record.start["rollout_id"], call.index)

    # ------------------------------------------------------------------ the engine's side

    def _take(self, idle: bool) -> Sequence[tuple[Pending, Request]] | None:
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
            self.in_flight.update(taken)
        return [(pending, pending.request) for pending in taken]

    def _give(self, pending: Pending, outcome: Completion | Exception) -> None:
        """A call's completion (or the engine's failure) goes to the coroutines waiting for it; a dropped
        call's is thrown away."""
        with self.arrived:
            self.in_flight.discard(pending)
            if pending.dropped.is_set():
                return
        call = pending.call
        if isinstance(outcome, Exception):
            call.error = RequestError(f"the engine failed: {outcome.__class__.__name__}: {outcome}", 500)
        else:
            call.completion, call.logprobs, call.finish_reason = (
                outcome.token_ids,
                outcome.logprobs,
                outcome.finish_reason,
            )
            reply_of(call, self.tokenizer, pending.record.start["rollout_id"])
            _cut_at_stop(call, pending.request.stop)
        with self.arrived:
            if pending.dropped.is_set():  # while its reply was made
                return
            del self.pending[id(call)]
            call.done.set()
            waiters, pending.waiters = pending.waiters, []
        for answered in waiters:
            answered.get_loop().call_soon_threadsafe(_resolve, answered)

    def _sample_forever(self) -> None:
        """The engine serves the calls as they come (continuous batching where it has it); if it fails, the
        calls it held fail (a 500) and it serves on."""
        while not self.stopped:
            try:
                self.engine.serve(self._take, self._give, self.sampling)
            except Exception as exc:
                with self.arrived:
                    failed = list(self.in_flight)
                for pending in failed:
                    self._give(pending, exc)
        with self.arrived:
            left = [*self.in_flight, *self.waiting]
        for pending in left:  # the run is over before they were answered
            self._give(pending, RuntimeError("the endpoint stopped"))


def _resolve(answered: asyncio.Future[None]) -> None:
    if not answered.done():  # not cancelled meanwhile
        answered.set_result(None)


def _cut_at_stop(call: Call, stops: tuple[str, ...]) -> None:
    """A call ended by a stop string replies with its text before it, as OpenAI's API does (the record
    keeps every token sampled, the stop string's included), trimmed as every reply text is (the text
    the agent sends back is matched against it)."""
    if call.finish_reason != FinishReason.STOP_STRING or not call.reply_text:
        return
    found = [call.reply_text.find(stop) for stop in stops if stop in call.reply_text]
    if found:
        call.reply_text = call.reply_text[: min(found)].rstrip()
