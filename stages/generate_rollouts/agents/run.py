"""One iteration of agent rollouts: serve the endpoint, run the agents in their child process until
each returned (or failed), and turn the record into the rows of each turn.

Where the agents run (agent.runner):
- `local`: one agents' process (child.py), a child of this one;
- `ray`: the rollouts split into agent.ray_tasks contiguous shards, each shard's agents in an agents'
  process that a Ray task starts on its node of the cluster at runner.ray_address (the nodes that
  have agent.ray_resources), each task streaming back its process's outcomes and output as they come
  (a Ray streaming generator). The endpoint binds agent.host; a task whose worker dies fails only the
  rollouts of its shard that had not returned.

Both start and read an agents' process the same way (runtime/piped_process.py): it reports its
outcomes on a pipe of its own; its stdout and stderr (what the agents print, log, and what their
subprocesses write) are appended by this process to RUNS_DIR/logs/agents-ITERATION.log, each run of
the iteration's agents under a line of its own (LOG_START), a rollout's lines tagged "[rollout ID] "
(child.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from runtime.piped_process import (
    EXITED,
    OUTPUT,
    REPORT,
    STARTED,
    Event,
    PipedProcess,
    UnreachableError,
    close,
    find_program,
    run_piped,
    run_piped_on_node,
    start_piped,
)
from runtime.ray import ray_cluster
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
# Module-level because a stage is a function of its inputs called once per turn (a Prefect task): no
# object of the pipeline's lives through an iteration's turns and may be handed to it; the key names
# the iteration, so two iterations made at once (ppo.max_staleness > 0) keep theirs apart.
RECORDS: OrderedDict[tuple[str, int, str], dict[int, RolloutRecord]] = OrderedDict()
RECORDS_KEPT = 2
LOG_START = "=== agents of iteration"  # the line that starts a run of an iteration's agents in its log
LOG_TAIL_LINES = 20  # of the log, in the failure of the rollouts a dead agents' process left unfinished
# Not PYTHONUNBUFFERED: the agents' Python subprocesses would write a line in pieces, which the pieces of
# others' lines split in the log (the agents' process writes whole lines unbuffered itself).
AGENTS_ENVIRONMENT = {"OPENAI_AGENTS_DISABLE_TRACING": "1"}
EVERY_INTERFACE = ("0.0.0.0", "::", "")  # agent.host values that bind every address of the machine

# An agents' process started when an iteration's agents are done, for the next iteration: Python's start
# and openai's import (0.8 s, bench/agents.py) happen while the update trains, not when the agents'
# calls should begin (agent.runner local only: a Ray task starts its process when it runs). Module-level
# as RECORDS is: the process outlives the stage call that started it, and the next iteration's call takes it.
SPARE: list[PipedProcess] = []


def agents_log(runs_dir: str | Path, iteration: int) -> Path:
    """The agents' log of an iteration."""
    return Path(runs_dir) / "logs" / f"agents-{iteration}.log"


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
    runs_dir: str | Path,
    iteration: int,
) -> dict[int, RolloutRecord]:
    """Every rollout's record once its agent returned, failed, or passed its deadline. What the
    agents print goes to the iteration's log in `runs_dir` (agents_log)."""
    python = agent_python(agent.python) if agent.runner == "local" else agent.python  # on Ray: found on the node
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
        host=agent.host,
    )
    log_path = agents_log(runs_dir, iteration)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _cluster(agent) as ray, endpoint, log_path.open("ab") as log:  # a resumed run appends to the log
        endpoint.running = set(records)
        # The address the agents connect to: agent.host, or where it binds every interface, this node's
        # address (as Ray sees it: the one the other nodes reach it by).
        address = agent.host if agent.host not in EVERY_INTERFACE else _this_node(ray)
        url = f"http://{f'[{address}]' if ':' in address else address}:{endpoint.http.port}"
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        if ray is None:
            agents = AgentsRun(starts, records, endpoint, log, iteration)
            process = _agents_process(python, {**os.environ, **AGENTS_ENVIRONMENT})
            log.write(f"{LOG_START} {iteration}: process {process.child.pid} of {python}, {started} ===\n".encode())
            for batch in run_piped(process, _request(agent, starts, url, endpoint.api_key)):
                agents.take(batch)
            SPARE.append(start_piped([python, CHILD], process.environment))  # the next iteration's, warming up
            agents.fail_unfinished(agents.exited())
        else:
            shards = _shards(starts, agent.ray_tasks)
            tasks = f"{len(shards)} Ray task{'s' if len(shards) > 1 else ''}"
            log.write(f"{LOG_START} {iteration}: {tasks}, from {address}, {started} ===\n".encode())
            runs = [
                AgentsRun(shard, records, endpoint, log, iteration, f"Ray task {k + 1} of {len(shards)}")
                for k, shard in enumerate(shards)
            ]
            requests = [_request(agent, shard, url, endpoint.api_key) for shard in shards]
            _run_on_ray(ray, agent, runs, requests, reach=(address, endpoint.http.port))
    return records


def agent_python(python: str | None) -> str:
    """The interpreter of the agents' process: agent.python (a path, relative to the working
    directory, or a command on PATH), or mtrl's own."""
    found = find_program(python)
    if found is None:
        raise ValueError(
            f"agent.python '{python}' is no executable file (relative to {os.getcwd()}, or on PATH): "
            "name the Python of the agent's own environment, e.g. .venv-agent/bin/python"
        )
    return found


class AgentsRun:
    """This process's side of one agents' process (the local one, or a Ray task's): its rollouts'
    outcomes applied to their records as they come (the endpoint told), its output appended to the
    iteration's log, its last lines kept for a failure text."""

    def __init__(
        self,
        starts: list[dict[str, Any]],
        records: dict[int, RolloutRecord],
        endpoint: Endpoint,
        log: IO[bytes],
        iteration: int,
        name: str = "",
    ) -> None:
        self.rollout_ids = [start["rollout_id"] for start in starts]
        self.records, self.endpoint, self.log, self.name = records, endpoint, log, name
        # Named in failures relative to the runs dir: a rollout's bytes do not depend on where the store is.
        self.log_name = f"{agents_log('', iteration)} in the runs dir"
        self.tail: deque[bytes] = deque(maxlen=LOG_TAIL_LINES)
        self.where: dict[str, Any] | None = None  # a Ray task's process: where it runs, once it started
        self.exit_code: int | None = None

    def take(self, events: list[Event]) -> None:
        for kind, value in events:
            if kind == OUTPUT:
                line = value if value.endswith(b"\n") else value + b"\n"  # its last, unfinished: ended here
                self.log.write(line)
                self.tail.append(line)
            elif kind == REPORT:
                self._outcome(json.loads(value))
            elif kind == STARTED:
                self.where = value
                rollouts = f"rollouts {self.rollout_ids[0]}-{self.rollout_ids[-1]}"
                self.log.write(
                    f"--- {self.name}, {rollouts}: process {value['pid']} of {value['program']}, Ray worker "
                    f"{value['worker_pid']} on node {value['node_id']} ({value['address']}) ---\n".encode()
                )
            elif kind == EXITED:
                self.exit_code = value
        self.log.flush()  # a reader (tail -f, mtrl view) sees it now

    def _outcome(self, outcome: dict[str, Any]) -> None:
        record = self.records[outcome["rollout_id"]]
        if "error" in outcome:
            tag = f"[rollout {outcome['rollout_id']}]"
            record.fail(f"{outcome['error']}; its output: {self.log_name}, the lines tagged {tag}")
        else:
            record.reward = outcome["reward"]
        self.endpoint.agent_returned(outcome["rollout_id"])

    def exited(self) -> str:
        """Why its unfinished rollouts failed, once its process exited (the same text wherever it ran:
        an agent that ends its process does so wherever it runs)."""
        tail = b"".join(self.tail).decode("utf-8", "replace").rstrip() or "(nothing)"
        return (
            f"the agents' process exited with code {self.exit_code} before this rollout's agent returned; "
            f"its log: {self.log_name}, ending with:\n{tail}"
        )

    def fail_unfinished(self, failure: str) -> None:
        """Fail its rollouts whose agents have not returned (the endpoint stops waiting for them)."""
        for rollout_id in self.rollout_ids:
            if rollout_id in self.endpoint.running:
                self.records[rollout_id].fail(failure)
                self.endpoint.agent_returned(rollout_id)


def _this_node(ray: Any | None) -> str:
    """This machine's address for the agents: 127.0.0.1 when they run here, else this node's as Ray sees it."""
    if ray is None:
        return "127.0.0.1"
    from ray.util import get_node_ip_address

    return get_node_ip_address()


@contextlib.contextmanager
def _cluster(agent: AgentSettings) -> Iterator[Any | None]:
    """The ray module connected to runner.ray_address (agent.runner ray), else None."""
    if agent.runner == "local":
        yield None
        return
    with ray_cluster(agent.ray_address, purpose="agent.runner ray") as ray:
        wanted = agent.ray_resources
        there = ray.cluster_resources()
        if any(there.get(name, 0.0) < amount for name, amount in wanted.items()):
            raise ValueError(
                f"agent.ray_resources {wanted}: no node of the Ray cluster at {agent.ray_address} has them (its "
                f"resources: {there}); start the agents' nodes with them, e.g. ray start --resources '{{\"agents\": 8}}'"
            )
        yield ray


def _run_on_ray(
    ray: Any, agent: AgentSettings, runs: list[AgentsRun], requests: list[bytes], reach: tuple[str, int]
) -> None:
    """Each shard's agents' process started by a Ray task on a node with agent.ray_resources (tasks
    spread over such nodes), never retried (an agent must not run twice), their events taken as they
    come. A task that fails (its worker or node lost) fails the rollouts of its shard not yet returned."""
    resources = dict(agent.ray_resources)
    task = ray.remote(run_piped_on_node).options(
        num_returns="streaming",
        max_retries=0,
        scheduling_strategy="SPREAD",
        num_cpus=resources.pop("CPU", 0),
        num_gpus=resources.pop("GPU", 0),
        memory=resources.pop("memory", None),
        resources=resources,
    )
    streams = {
        task.remote(agent.python, [CHILD], AGENTS_ENVIRONMENT, os.getcwd(), request, reach): run
        for run, request in zip(runs, requests)
    }
    try:
        while streams:
            ready, _ = ray.wait(list(streams), num_returns=1)
            try:
                streams[ready[0]].take(ray.get(next(ready[0])))
            except StopIteration:
                run = streams.pop(ready[0])
                run.fail_unfinished(run.exited())
            except ray.exceptions.RayError as error:
                _ray_task_failed(streams.pop(ready[0]), error)
    finally:
        for stream in streams:  # cancelled (an error here): its worker dies and its process with it
            ray.cancel(stream, force=True)


def _ray_task_failed(run: AgentsRun, error: Exception) -> None:
    """A task that raised before its process started is a setting the node cannot meet (no such
    working directory or Python there, the endpoint out of its reach): the stage fails, saying so.
    Else its worker or node was lost: the rollouts it held fail."""
    cause = getattr(error, "cause", None)  # a task's own exception (Ray's own errors have none)
    if run.where is None and isinstance(cause, UnreachableError):
        raise ValueError(
            f"agent.runner ray, {run.name}: the endpoint cannot be reached from the agents' node: {cause}; "
            "agent.host must be an address the nodes reach (0.0.0.0: every interface, the agents told this "
            "node's address as Ray sees it)"
        ) from None
    if run.where is None and isinstance(cause, OSError):
        raise ValueError(
            f"agent.runner ray, {run.name}: {cause}; every agents' node needs mtrl's working directory, mtrl "
            "and the agent's Python (agent.python) at the same paths as this machine"
        ) from None
    where = "" if run.where is None else f", node {run.where['node_id']} ({run.where['address']})"
    failed = "failed" if cause is not None else f"was lost ({type(error).__name__}: its Ray worker or node died)"
    detail = f": {cause}" if cause is not None else ""
    run.fail_unfinished(
        f"the {run.name} that ran this rollout's agent{where} {failed} before the agent returned{detail}; "
        f"its log: {run.log_name}"
    )


def _shards(starts: list[dict[str, Any]], tasks: int) -> list[list[dict[str, Any]]]:
    """The rollouts in `tasks` contiguous shards of sizes that differ by one at most (no empty one)."""
    count = min(tasks, len(starts))
    size, extra = divmod(len(starts), count)
    bounds = [k * size + min(k, extra) for k in range(count + 1)]
    return [starts[bounds[k] : bounds[k + 1]] for k in range(count)]


def _request(agent: AgentSettings, starts: list[dict[str, Any]], url: str, api_key: str) -> bytes:
    """What an agents' process reads on its stdin (child.py): the function, the endpoint, its rollouts."""
    spec = {
        "function": agent.function,
        "base_url": url,
        "api_key": api_key,
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
    return (json.dumps(spec) + "\n").encode()


def _agents_process(python: str, environment: dict[str, str]) -> PipedProcess:
    """The spare agents' process started at the end of the previous iteration, if it still waits with
    this interpreter and environment, else a new one."""
    while SPARE:
        spare = SPARE.pop()
        if spare.child.poll() is None and (spare.command[0], spare.environment) == (python, environment):
            return spare
        close(spare)
    return start_piped([python, CHILD], environment)


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
