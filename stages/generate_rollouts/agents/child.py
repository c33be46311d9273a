"""The process that runs the user's agent program, one call per rollout, concurrently.

    PYTHON stages/generate_rollouts/agents/child.py OUTCOMES_FD

Run by path (its package imports torch), by any Python: `agent.python` may name an environment of
the agent's own, so this file needs the standard library only. It reads one JSON object on stdin
(the function, the endpoint, the rollouts, the limits) and writes one JSON line per rollout on the
pipe OUTCOMES_FD as its agent returns: {"rollout_id", "reward"} or {"rollout_id", "error"}. That pipe
is its own: nothing the agents print can be read as an outcome.

Its stdout and stderr are the agents' log (the parent appends them to RUNS_DIR/logs/agents-N.log).
What the agent code writes through sys.stdout, sys.stderr or `logging` arrives in whole lines, each
tagged with its rollout, "[rollout 7] ..." (the rollout of the asyncio task or the agent's thread that
wrote it); what reaches file descriptors 1 and 2 otherwise (a subprocess, C code, a thread the agent
started itself) arrives as written, untagged.

An agent that raises or passes its deadline fails its rollout only. The parent kills this process
(and whatever the agents started in its process group) when the iteration's agents are done or mtrl
exits; a sync agent that hangs is left in its thread until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import importlib
import inspect
import io
import json
import math
import os
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

# The rollout whose agent runs in this asyncio task or thread: each rollout's task sets it, its sync
# agent's thread runs in a copy of the task's context, and an agent's own tasks copy it too.
ROLLOUT: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout", default=None)
TAG = "[rollout {}] "  # the prefix of a rollout's lines in the agents' log (pipeline/monitoring/viewer.py reads it)


@dataclass
class AgentRollout:
    """What an agent program gets for one rollout: its task, the task's own first messages and tools
    (what the native loop would show the model), and an OpenAI-compatible endpoint of its own."""

    rollout_id: int
    task: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    base_url: str  # ends with /v1
    api_key: str
    model: str
    _tls: Any = field(default=None, repr=False)  # the process's one ssl.SSLContext, for every rollout's client
    _client: Any = field(default=None, repr=False)

    @property
    def client(self) -> Any:
        """A ready openai.AsyncOpenAI for this rollout's endpoint, on an httpx client of its own built with
        the process's one TLS context. Not one httpx client for all rollouts: its pool scans every
        connection at each request and each response's end, so 1,024 rollouts spent 47 s of CPU in that
        scan for 1,523 calls; not httpx's default either: loading a TLS context took 50 ms per client."""
        if self._client is None:
            import httpx
            import openai

            http = httpx.AsyncClient(verify=self._tls if self._tls is not None else True, timeout=None)
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=http)
        return self._client

    async def close(self) -> None:
        """Close the client's connections (the agent has returned)."""
        if self._client is not None:
            with contextlib.suppress(Exception):  # an agent's own use of it cannot fail its outcome now
                await self._client.close()


class TaggedLines(io.TextIOBase):
    """What sys.stdout and sys.stderr become: text written to file descriptor `fd` in whole lines,
    each tagged with the rollout (ROLLOUT) that wrote it. A line in progress waits for its end apart
    for each rollout, so concurrent agents' lines never mix; both streams share `lock` (they go to
    one pipe, and one line is one write)."""

    def __init__(self, fd: int, lock: threading.Lock) -> None:
        super().__init__()
        self._fd = fd
        self._lock = lock
        self._unfinished: dict[int | None, str] = {}

    @property
    def encoding(self) -> str:
        return "utf-8"

    @property
    def buffer(self) -> BinaryIO:
        """Bytes written past the text layer (some console libraries do): to the same log, untagged."""
        return open(self._fd, "wb", buffering=0, closefd=False)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # a subprocess handed sys.stdout writes to the log itself, untagged
        return self._fd

    def write(self, text: str) -> int:
        rollout = ROLLOUT.get()
        with self._lock:
            *lines, rest = (self._unfinished.pop(rollout, "") + text).split("\n")
            if rest:
                self._unfinished[rollout] = rest
            self._write_lines(rollout, lines)
        return len(text)

    def end(self, rollout: int | None) -> None:
        """Write out what `rollout` left of an unfinished line (its agent is done)."""
        with self._lock:
            if rollout in self._unfinished:
                self._write_lines(rollout, [self._unfinished.pop(rollout)])

    def end_all(self) -> None:
        for rollout in list(self._unfinished):
            self.end(rollout)

    def _write_lines(self, rollout: int | None, lines: list[str]) -> None:
        tag = "" if rollout is None else TAG.format(rollout)
        data = "".join(f"{tag}{line}\n" for line in lines).encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self._fd, data) :]


def outcome_channel(fd: int) -> TextIO:
    """The outcomes' pipe, moved from the number the parent passed to one that no process this one
    starts inherits (close-on-exec) and that is none of 0-2."""
    private = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return open(private, "w", encoding="utf-8", buffering=1)  # one line per outcome, each at once


def load_function(spec: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


async def within_deadline(function: Any, rollout: AgentRollout, timeout_s: float, pool: Any) -> Any:
    """What the agent returns; its deadline runs from when it starts. A sync agent (`pool` given)
    runs in a thread of the pool, in a copy of this task's context (its rollout)."""
    if pool is None:
        return await asyncio.wait_for(function(rollout), timeout_s)
    loop = asyncio.get_running_loop()
    started = loop.create_future()

    def in_thread() -> Any:
        loop.call_soon_threadsafe(started.set_result, None)
        return function(rollout)

    running = loop.run_in_executor(pool, contextvars.copy_context().run, in_thread)
    await started
    return await asyncio.wait_for(running, timeout_s)


async def run_one(function: Any, rollout: AgentRollout, timeout_s: float, pool: Any) -> dict[str, Any]:
    try:
        result = await within_deadline(function, rollout, timeout_s, pool)
    except TimeoutError:
        return {"rollout_id": rollout.rollout_id, "error": f"the agent did not return within {timeout_s:g} s"}
    except Exception as exc:
        traceback.print_exception(exc)  # to the log, under this rollout's tag
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({os.path.basename(last.filename)}:{last.lineno})"
        return {"rollout_id": rollout.rollout_id, "error": f"the agent raised {exc.__class__.__name__}: {exc}{where}"}
    if result is not None and not isinstance(result, int | float | list):
        return {
            "rollout_id": rollout.rollout_id,
            "error": f"the agent returned {type(result).__name__}: expected a reward",
        }
    reward = float(result) if isinstance(result, int | float) else None
    if reward is not None and not math.isfinite(reward):
        return {"rollout_id": rollout.rollout_id, "error": f"the agent returned the reward {reward}"}
    return {"rollout_id": rollout.rollout_id, "reward": reward}


async def main(spec: dict[str, Any], outcomes: TextIO, streams: tuple[TaggedLines, ...]) -> None:
    function = load_function(spec["function"])
    limit = asyncio.Semaphore(spec["concurrency"])
    # A sync agent runs in a thread of this pool. It has a thread for every rollout, so a rollout whose
    # slot (`limit`) is free starts at once, and a thread that a hung agent keeps past its deadline
    # never holds back the next one; threads are made as needed and reused: about `concurrency` of them.
    pool = None
    if not inspect.iscoroutinefunction(function):
        pool = ThreadPoolExecutor(max_workers=max(1, len(spec["rollouts"])), thread_name_prefix="agent")

    async def bounded(rollout: AgentRollout) -> None:
        ROLLOUT.set(rollout.rollout_id)  # this task's own context: its agent's lines are tagged with it
        async with limit:
            outcome = await run_one(function, rollout, spec["timeout_s"], pool)
        for stream in streams:
            stream.end(rollout.rollout_id)
        outcomes.write(json.dumps(outcome) + "\n")
        await rollout.close()

    try:
        import httpx  # openai's transport
    except ImportError:  # an agent environment without it: the openai client cannot be in it either
        tls = None
    else:  # an httpx without create_ssl_context: each client loads its own
        tls = httpx.create_ssl_context() if hasattr(httpx, "create_ssl_context") else None
    rollouts = [
        AgentRollout(
            rollout_id=start["rollout_id"],
            task=start["task"],
            messages=start["messages"],
            tools=start["tools"],
            base_url=f"{spec['base_url']}/rollouts/{start['rollout_id']}/v1",
            api_key=spec["api_key"],
            model=spec["model"],
            _tls=tls,
        )
        for start in spec["rollouts"]
    ]
    await asyncio.gather(*(bounded(rollout) for rollout in rollouts))


def warm_up() -> None:
    """Import what agents' clients import (0.6 s for openai) while waiting for the rollouts: mtrl starts
    this process ahead, at the end of the previous iteration."""
    for module in ("httpx", "openai"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this file's folder: its modules would shadow the agent's (run.py, record.py)
    outcomes = outcome_channel(int(sys.argv[1]))
    lock = threading.Lock()
    sys.stdout, sys.stderr = streams = (TaggedLines(1, lock), TaggedLines(2, lock))
    warm_up()
    # not asyncio.run: its clean-up waits for the threads of sync agents, and a hung one never ends
    asyncio.new_event_loop().run_until_complete(main(json.loads(sys.stdin.readline()), outcomes, streams))
    for stream in streams:
        stream.end_all()
    outcomes.flush()
    os._exit(0)  # a sync agent still hung in its thread must not keep the process alive
