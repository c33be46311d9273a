"""One iteration of agent rollouts: serve the endpoint, run the agents in their child process until
each returned (or failed), and turn the record into the rows of each turn."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from runtime.processes import popen_for_this_process
from schemas.features import AGENT_STATE, FinishReason, StopReason
from stages.generate_rollouts.agents import AgentSettings
from stages.generate_rollouts.agents.endpoint import Endpoint
from stages.generate_rollouts.agents.record import RolloutRecord
from stages.generate_rollouts.engine import GenerationEngine, Sampling

# Run by path, not as a module of this package: importing stages.generate_rollouts would import torch
# and transformers into the agents' process (4 s at every iteration's start, measured).
CHILD = str(Path(__file__).with_name("child.py"))
MODEL_NAME = "policy"  # the model name the endpoint answers to (any name is accepted)
# The records of the iterations run in this process, by (policy version, iteration, settings): every
# turn's generate-rollouts reads its calls from them. A process that lost them (a resumed run) runs
# the agents again: seeded per rollout and call, a deterministic agent makes the same calls.
RECORDS: OrderedDict[tuple[str, int, str], dict[int, RolloutRecord]] = OrderedDict()
RECORDS_KEPT = 2
# An agents' process started when an iteration's agents are done, for the next iteration: Python's start
# and openai's import (0.8 s, bench/agents.py) happen while the update trains, not when the agents'
# calls should begin.
SPARE: list[subprocess.Popen] = []


def run_agents(
    engine: GenerationEngine,
    tokenizer: Any,
    starts: list[dict[str, Any]],
    agent: AgentSettings,
    *,
    call_limits: dict[str, int],
    sampling: Sampling,
    max_new_tokens: int,
    max_context_tokens: int,
    enable_thinking: bool,
    seed_of: Any,
) -> dict[int, RolloutRecord]:
    """Every rollout's record once its agent returned, failed, or passed its deadline."""
    records = {start["rollout_id"]: RolloutRecord(start, call_limits[start["task"]]) for start in starts}
    endpoint = Endpoint(
        engine,
        tokenizer,
        records,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        max_context_tokens=max_context_tokens,
        enable_thinking=enable_thinking,
        seed_of=seed_of,
        model=MODEL_NAME,
        api_key=secrets.token_hex(16),
    )
    with endpoint:
        endpoint.running = set(records)
        spec = {
            "function": agent.function,
            "base_url": endpoint.base_url,
            "api_key": endpoint.api_key,
            "model": MODEL_NAME,
            "concurrency": agent.concurrency or len(starts),
            "timeout_s": agent.timeout_s,
            "rollouts": [
                {
                    "rollout_id": start["rollout_id"],
                    "task": json.loads(start["task_payload"]),
                    "messages": start["messages"],
                    "tools": start["tools"],
                }
                for start in starts
            ],
        }
        environment = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONUNBUFFERED": "1"}
        child = _agents_process(environment)
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.extend(child.stderr), daemon=True)
        drain.start()
        try:
            child.stdin.write(json.dumps(spec) + "\n")
            child.stdin.close()
            for line in child.stdout:
                outcome = json.loads(line)
                record = records[outcome["rollout_id"]]
                if "error" in outcome:
                    record.fail(outcome["error"])
                else:
                    record.reward = outcome["reward"]
                endpoint.agent_returned(record.start["rollout_id"])
            child.wait()
            SPARE.append(_start_agents_process(environment))  # the next iteration's, warming up meanwhile
        finally:
            _kill(child)  # if it still runs, and whatever its agents left running
        drain.join(timeout=5)
        for record in records.values():
            if record.start["rollout_id"] in endpoint.running:
                tail = "".join(stderr)[-800:].strip()
                record.fail(
                    f"the agent process exited with code {child.returncode} before this rollout's agent returned: {tail}"
                )
    return records


def _start_agents_process(environment: dict[str, str]) -> subprocess.Popen:
    """The agents' process, waiting for its rollouts on stdin; SIGKILLed when mtrl dies, however it
    dies (runtime/processes.py)."""
    process = popen_for_this_process(
        [sys.executable, CHILD],
        signal.SIGKILL,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        start_new_session=True,  # what the agents start is in its group, killed with it
    )
    process.environment = environment
    return process


def _agents_process(environment: dict[str, str]) -> subprocess.Popen:
    """The spare agents' process started at the end of the previous iteration, if it still waits with
    this environment, else a new one."""
    while SPARE:
        spare = SPARE.pop()
        if spare.poll() is None and spare.environment == environment:
            return spare
        _kill(spare)
    return _start_agents_process(environment)


def _kill(process: subprocess.Popen) -> None:
    """Kill an agents' process and its process group."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _ending(record: RolloutRecord) -> dict[str, Any]:
    if record.failure is not None:
        return {"stop_reason": StopReason.FAILED, "failure": record.failure, "reward": None}
    if record.cut:
        return {"stop_reason": StopReason.MAX_TURNS, "failure": None, "reward": None}
    return {"stop_reason": StopReason.DONE, "failure": None, "reward": record.reward}


def agent_rows(records: dict[int, RolloutRecord], turn: int, tokenizer: Any) -> list[dict[str, Any]]:
    """The generate-rollouts rows of turn `turn`: the call of that index of every rollout that made it
    (a rollout with no call at all gets a failed turn 0). Its env_state holds what the agent did after
    the call: the tokens and messages it added, and on its last call how the rollout ended."""
    rows = []
    for rollout_id in sorted(records):
        record = records[rollout_id]
        calls = [call for call in record.calls if call.error is None and call.done.is_set()]
        identity = {name: record.start[name] for name in ("rollout_id", "group_id", "task", "task_id", "task_payload")}
        if not calls and turn == 0:
            failure = record.failure or "the agent made no model call"
            end = {"stop_reason": StopReason.FAILED, "failure": failure, "reward": None}
            state = {"observation_token_ids": [], "added_messages": [], "end": end}
            rows.append(
                {
                    **identity,
                    "env_state": json.dumps({AGENT_STATE: state}),
                    "turn": 0,
                    "sampling_seed": 0,
                    "stream_offset": 0,
                    "context_token_ids": [],
                    "completion_token_ids": [],
                    "completion_logprobs": [],
                    "finish_reason": FinishReason.FAILED,
                    "thinking": "",
                    "content": "",
                    "failed": True,
                    "failure": failure,
                }
            )
            continue
        if turn >= len(calls):
            continue
        call = calls[turn]
        last = turn == len(calls) - 1
        end = _ending(record) if last else None
        if end is not None and end["stop_reason"] == StopReason.DONE and end["reward"] is None:
            if call.finish_reason == FinishReason.LENGTH:  # its final answer was cut: overlong, as natively
                end["stop_reason"] = StopReason.LENGTH
        state = {
            "observation_token_ids": [] if last else call.observation,
            "added_messages": call.added_messages,
            "end": end,
        }
        rows.append(
            {
                **identity,
                "env_state": json.dumps({AGENT_STATE: state}),
                "turn": turn,
                "sampling_seed": call.seed,
                "stream_offset": len(call.stream) - len(call.context),
                "context_token_ids": call.context,
                "completion_token_ids": call.completion,
                "completion_logprobs": call.logprobs,
                "finish_reason": call.finish_reason,
                "thinking": call.thinking,
                "content": call.content,
                "failed": False,
                "failure": None,
            }
        )
    return rows
