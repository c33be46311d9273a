"""generate-rollouts: one assistant turn for every active rollout, token in, token out.

Each rollout's context is its exact token stream (docs/token-stream.md); the engine
(`generation.engine`, engine.py; the HF engine in hf.py) samples the completions. Every
sampled token is stored with its logprob under the convention

    completion_logprobs[i] = log_softmax(logits / temperature)[token_i]

taken before any top-k/top-p truncation, and each rollout turn has its own sampling seed.

Turn 0 samples the iteration's tasks and renders their prompts; turn t continues the rollouts
that turn t - 1's execute-tools left active. A turn reads that one previous turn, never every
earlier one: the rollouts' token streams are kept in memory from turn to turn (STREAMS, by
version), and the whole history is read only when they are not there (a resumed run, `mtrl
stage`), once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import datasets

from runtime.phases import PHASES
from schemas.features import GENERATE_ROLLOUTS, FinishReason, dataset_from_rows
from schemas.stage import POLICY, Inputs, Output, Settings, Stage, read
from schemas.task_mix import groups_per_task
from schemas.token_stream import (
    CONTEXT_CONVENTION,
    chat_template_hash,
    continue_streams,
    generation_prompt_ids,
    prompt_token_ids,
    rollouts,
)
from stages.generate_rollouts import hf, vllm_engine  # noqa: F401  (register the "hf" and "vllm" engines)
from stages.generate_rollouts.agents import AgentSettings
from stages.generate_rollouts.agents.record import RolloutRecord
from stages.generate_rollouts.agents.run import RECORDS, RECORDS_KEPT, agent_rows, run_agents
from stages.generate_rollouts.engine import ENGINE, Completion, EngineSettings, GenerationEngine, Request
from stages.hermes import split_thinking
from stages.policy.loading import load_tokenizer
from stages.registry import Tasks, check_tasks, start_task, tool_schemas


class GenerateSettings(Settings):
    engine: EngineSettings  # the engine, the sampling settings, the context budget, the seed
    tasks: Tasks
    rollouts: int = read("task.rollouts")
    group_size: int = read("task.group_size")
    max_new_tokens: int = read("generation.max_new_tokens")
    enable_thinking: bool = read("generation.enable_thinking")
    sandbox: bool = read("tools.sandbox")  # the tasks' tools are checked importable by a sandbox worker
    agent: AgentSettings  # an agent program instead of the native loop (agents/)

    def call_limit(self, task: str) -> int:
        """A rollout's turns (native) or model calls (an agent's) at most."""
        return self.agent.max_calls or self.tasks.turn_limit(task)

    def turn_limit(self) -> int:
        """Rounds of an iteration at most: the longest limit of the task mix."""
        return max(self.call_limit(name) for name in self.tasks.names())


def sampling_seed(seed: int, iteration: int, rollout_id: int, turn: int) -> int:
    """A 63-bit seed per rollout turn, independent of batch composition."""
    digest = hashlib.sha256(f"{seed}/{iteration}/{rollout_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_context_budget(max_context_tokens: int, max_model_len: int) -> None:
    """A rollout's context budget must fit the model: past its positions the model cannot go
    on, and the rollout would end as a failure instead of a truncation."""
    if max_context_tokens > max_model_len:
        raise ValueError(
            f"generation.max_context_tokens ({max_context_tokens}) exceeds the longest context the model "
            f"takes ({max_model_len} tokens): set it to at most {max_model_len}"
        )


def rollout_starts(settings: GenerateSettings, iteration: int) -> list[dict[str, Any]]:
    """The iteration's tasks: rollouts / group_size groups, each one task of one environment
    (split by the task mix) sampled group_size times. A group never mixes tasks."""
    check_tasks(settings.tasks, settings.sandbox)
    rng = random.Random(f"tasks/{settings.engine.seed}/{iteration}")
    tools = settings.tasks.tools()
    starts = []
    for group_id, name in enumerate(groups_per_task(settings.tasks.mix, settings.rollouts // settings.group_size)):
        found = settings.tasks.environment(name)
        schemas = tool_schemas(found, tools)
        task, messages = start_task(found, name, rng)
        for _ in range(settings.group_size):
            starts.append(
                {
                    "rollout_id": len(starts),
                    "group_id": group_id,
                    "task": name,
                    "task_id": f"{name}-{iteration}-{group_id}",
                    "task_payload": json.dumps(task, sort_keys=True),
                    "messages": messages,
                    "tools": schemas,
                }
            )
    return starts


IDENTITY = ("rollout_id", "group_id", "task", "task_id", "task_payload")  # a rollout's, on each of its rows


def first_turn(tokenizer: Any, settings: GenerateSettings, iteration: int) -> list[dict[str, Any]]:
    """The pending rows of turn 0 (each with its `stream`, the tokens the model sees): the
    iteration's tasks, their prompts rendered."""
    pending = []
    for start in rollout_starts(settings, iteration):
        context = prompt_token_ids(tokenizer, start["messages"], start["tools"], settings.enable_thinking)
        row = {name: start[name] for name in IDENTITY}
        pending.append({**row, "env_state": "{}", "context_token_ids": context, "stream": context, "stop": ()})
    return pending


def next_turn(
    tokenizer: Any, settings: GenerateSettings, previous: datasets.Dataset, streams: dict[int, list[int]]
) -> list[dict[str, Any]]:
    """The pending rows of the turn after `previous` (an execute-tools dataset): its rollouts that
    go on, their streams so far (`streams`, after `previous`) followed by the generation prompt."""
    context = generation_prompt_ids(tokenizer, settings.enable_thinking)
    columns = [*IDENTITY, "stop_reason", "next_stop", "next_env_state"]
    pending = []
    for row in sorted(previous.select_columns(columns).to_list(), key=lambda row: row["rollout_id"]):
        if row["stop_reason"] is None:
            pending.append(
                {
                    **{name: row[name] for name in IDENTITY},
                    "env_state": row["next_env_state"],
                    "context_token_ids": list(context),
                    "stream": streams[row["rollout_id"]] + context,
                    "stop": tuple(row["next_stop"] or ()),
                }
            )
    return pending


def generate_rollouts(
    engine: GenerationEngine,
    tokenizer: Any,
    settings: GenerateSettings,
    pending: list[dict[str, Any]],
    *,
    iteration: int,
    turn: int,
    policy_version: str,
    earlier_turns: Callable[[], datasets.Dataset] | None = None,
    report_progress: Callable[[float], None] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any] | None]:
    """One assistant turn for each pending row (first_turn, next_turn), and how the engine replayed
    the earlier turns first (None: it did not need to). `earlier_turns` gives the stored earlier
    turns to an engine that lost its state; `report_progress` receives the share of the turn
    decoded so far."""
    check_context_budget(settings.engine.max_context_tokens, engine.max_model_len)
    rows = [{name: value for name, value in row.items() if name not in ("stream", "stop")} for row in pending]
    requests = []
    for row, waiting in zip(rows, pending):
        stream = waiting["stream"]
        row["sampling_seed"] = sampling_seed(settings.engine.seed, iteration, row["rollout_id"], turn)
        row["stream_offset"] = len(stream) - len(row["context_token_ids"])
        row["failed"], row["failure"] = False, None
        budget = min(settings.max_new_tokens, settings.engine.max_context_tokens - len(stream))
        if budget >= 1:  # else a prompt longer than the context: an empty turn, a truncation
            requests.append(Request(row["rollout_id"], stream, row["sampling_seed"], budget, waiting["stop"]))
    with PHASES.span("stage_compute"):  # the stage's own work, apart from reading and writing (bench/long_episodes.py)
        generation = engine.generate(requests, settings.engine.sampling(), earlier_turns, report_progress)
    completions = {request.key: completion for request, completion in zip(requests, generation.completions)}

    for row in rows:
        completion = completions.get(row["rollout_id"], Completion([], [], FinishReason.LENGTH))
        thinking, content = split_thinking(tokenizer.decode(completion.token_ids, skip_special_tokens=True))
        row.update(
            iteration=iteration,
            turn=turn,
            policy_version=policy_version,
            completion_token_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            thinking=thinking,
            content=content,
        )
    return dataset_from_rows(rows, GENERATE_ROLLOUTS), generation.replay


def provenance(settings: GenerateSettings, tokenizer: Any) -> dict[str, Any]:
    """How the rollouts were sampled, for the manifest: settings, conventions, template hash."""
    engine = settings.engine
    sampling = {"temperature": engine.temperature, "top_p": engine.top_p, "top_k": engine.top_k, "seed": engine.seed}
    return {
        "sampling": {
            **sampling,
            "max_new_tokens": settings.max_new_tokens,
            "enable_thinking": settings.enable_thinking,
        },
        "logprob_convention": "log_softmax(logits / temperature) of the sampled token, before top-k/top-p",
        "context_convention": CONTEXT_CONVENTION,
        "chat_template_sha256": chat_template_hash(tokenizer),
    }


# The streams of each turn's rollouts before it, by the generate-rollouts version of that turn: the
# next turn extends them by that turn's rows. A few versions: one or two iterations generate at once.
# Module-level because each turn is a separate call of the stage (a Prefect task) that gets datasets, not
# objects; a process that does not hold a turn's streams rebuilds them from the store (streams_before).
STREAMS: OrderedDict[str, dict[int, list[int]]] = OrderedDict()
STREAMS_KEPT = 4


def streams_before(
    inputs: Inputs, previous: datasets.Dataset, history: Callable[[], datasets.Dataset]
) -> dict[int, list[int]]:
    """Every continuing rollout's token stream after the previous turn (`previous`, its rows): the
    streams that turn started from (kept from when it was generated in this process) extended by
    its rows, or, when this process did not generate it, rebuilt from every stored turn (`history`)."""
    previous_generation = inputs.manifest("execute-tools").parents["generate-rollouts"]
    if previous_generation in STREAMS:
        return continue_streams(STREAMS[previous_generation], previous)
    return {rollout.rollout_id: rollout.token_ids for rollout in rollouts(history())}


def remember_streams(version: str, pending: list[dict[str, Any]]) -> None:
    STREAMS[version] = {
        row["rollout_id"]: row["stream"][: len(row["stream"]) - len(row["context_token_ids"])] for row in pending
    }
    while len(STREAMS) > STREAMS_KEPT:
        STREAMS.popitem(last=False)


def run(
    inputs: Inputs,
    settings: GenerateSettings,
    *,
    iteration: int,
    turn: int,
    report_progress: Callable[[float], None] | None = None,
) -> Output:
    """generate-rollouts of turn `turn` of iteration `iteration`: the policy (input "policy") after
    the previous turn's execute-tools version (input "execute-tools", from turn 1 on)."""
    policy_dir = inputs.folder(POLICY)
    tokenizer = load_tokenizer(str(policy_dir))
    engine = ENGINE.serving(policy_dir, tokenizer, settings.engine)
    if settings.agent.function is not None:
        return agent_turn(engine, tokenizer, settings, inputs.parents[POLICY], iteration, turn)
    # every earlier turn, read only where this process lost them (the streams, the engine's caches), once
    history = functools.cache(lambda: inputs.turns("execute-tools"))
    if turn == 0:
        pending = first_turn(tokenizer, settings, iteration)
    else:
        previous = inputs.load("execute-tools")
        pending = next_turn(tokenizer, settings, previous, streams_before(inputs, previous, history))
    dataset, replay = generate_rollouts(
        engine,
        tokenizer,
        settings,
        pending,
        iteration=iteration,
        turn=turn,
        policy_version=inputs.parents[POLICY],
        earlier_turns=history if turn else None,
        report_progress=report_progress,
    )
    remember_streams(inputs.version, pending)
    provenance_fields = provenance(settings, tokenizer) | {"engine": engine.describe()}
    # a cold engine (a resumed run) replays the earlier turns first; 0.0 means bit-identical
    return Output(dataset, {"provenance": provenance_fields, "replay": replay})


def agent_records(
    engine: GenerationEngine, tokenizer: Any, settings: GenerateSettings, iteration: int
) -> dict[int, RolloutRecord]:
    """The iteration's agent rollouts, run against the endpoint until each returned or failed."""
    return run_agents(
        engine,
        tokenizer,
        rollout_starts(settings, iteration),
        settings.agent,
        call_limits={name: settings.call_limit(name) for name in settings.tasks.names()},
        sampling=settings.engine.sampling(),
        max_new_tokens=settings.max_new_tokens,
        max_context_tokens=settings.engine.max_context_tokens,
        enable_thinking=settings.enable_thinking,
        seed_of=lambda rollout_id, call: sampling_seed(settings.engine.seed, iteration, rollout_id, call),
        runs_dir=settings.engine.runs_dir,  # the agents' log goes to its logs/ (a placement setting: not versioned)
        iteration=iteration,
    )


def agent_turn(
    engine: GenerationEngine, tokenizer: Any, settings: GenerateSettings, policy_version: str, iteration: int, turn: int
) -> Output:
    """Turn `turn` of an iteration of agent rollouts: the calls of that index (agents/run.py). The
    agents run at turn 0, or when this process has no record of the iteration (a resumed run)."""
    check_context_budget(settings.engine.max_context_tokens, engine.max_model_len)
    key = (policy_version, iteration, settings.model_dump_json())
    if key not in RECORDS:
        with PHASES.span("stage_compute"):
            RECORDS[key] = agent_records(engine, tokenizer, settings, iteration)
        while len(RECORDS) > RECORDS_KEPT:
            RECORDS.popitem(last=False)
    rows = agent_rows(RECORDS[key], turn, tokenizer)
    for row in rows:
        row.update(iteration=iteration, policy_version=policy_version)
    provenance_fields = provenance(settings, tokenizer) | {
        "engine": engine.describe(),
        "agent": settings.agent.function,
    }
    return Output(dataset_from_rows(rows, GENERATE_ROLLOUTS), {"provenance": provenance_fields, "replay": None})


STAGE = Stage(
    name="generate-rollouts",
    inputs=(POLICY, "execute-tools"),  # the policy, and the previous turn (from turn 1 on)
    features=GENERATE_ROLLOUTS,
    settings=GenerateSettings,
    run=run,
    # the worker extension the vLLM servers mtrl starts load each policy with (not imported here)
    code=("stages/generate_rollouts/vllm_extension",),
)
