"""The process that runs the user's agent program, one call per rollout, concurrently.

    python stages/generate_rollouts/agents/child.py      (by path: its package imports torch)

reads one JSON object on stdin (the function, the endpoint, the rollouts, the limits) and writes one
JSON line per rollout as its agent returns: {"rollout_id", "reward"} or {"rollout_id", "error"}. An
agent that raises or passes its deadline fails its rollout only. The parent kills this process (and
whatever the agents started in its process group) when the iteration's agents are done or mtrl
exits; a sync agent that hangs is left in its thread until then.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any


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
    _http: Any = field(default=None, repr=False)  # one httpx.AsyncClient shared by every rollout's client
    _client: Any = field(default=None, repr=False)

    @property
    def client(self) -> Any:
        """A ready openai.AsyncOpenAI for this rollout's endpoint (its own client each built 21 ms of
        connection pool: 1.4 s for 64 rollouts; sharing one httpx client, 0.08 s: bench/agents.py)."""
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=self._http)
        return self._client


def load_function(spec: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


async def run_one(function: Any, rollout: AgentRollout, timeout_s: float) -> dict[str, Any]:
    async def call() -> Any:
        if inspect.iscoroutinefunction(function):
            return await function(rollout)
        return await asyncio.to_thread(function, rollout)

    try:
        result = await asyncio.wait_for(call(), timeout_s)
    except TimeoutError:
        return {"rollout_id": rollout.rollout_id, "error": f"the agent did not return within {timeout_s:g} s"}
    except Exception as exc:
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


async def main(spec: dict[str, Any]) -> None:
    function = load_function(spec["function"])
    limit = asyncio.Semaphore(spec["concurrency"])

    async def bounded(rollout: AgentRollout) -> None:
        async with limit:
            outcome = await run_one(function, rollout, spec["timeout_s"])
        print(json.dumps(outcome), flush=True)

    import httpx  # openai's transport

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), timeout=None)
    rollouts = [
        AgentRollout(
            rollout_id=start["rollout_id"],
            task=start["task"],
            messages=start["messages"],
            tools=start["tools"],
            base_url=f"{spec['base_url']}/rollouts/{start['rollout_id']}/v1",
            api_key=spec["api_key"],
            model=spec["model"],
            _http=http,
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
    warm_up()
    # not asyncio.run: its clean-up waits for the threads of sync agents, and a hung one never ends
    asyncio.new_event_loop().run_until_complete(main(json.loads(sys.stdin.readline())))
    sys.stdout.flush()
    os._exit(0)  # a sync agent still hung in its thread must not keep the process alive
