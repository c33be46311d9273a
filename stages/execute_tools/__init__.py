"""execute-tools: parse the tool calls of each assistant turn, run them, and append
the tool/environment observation to the rollout as exact chat-template delta tokens.

Reads one generate-rollouts round (and the tokenizer of the policy that generated it); writes one
row per rollout turn with everything known about that turn (generation columns + tool calls +
observation + termination). Its rows are independent: with the ray runner they run as Ray tasks
over runner.shards shards.

    calls.py   parse_tool_calls, argument validation, run_tool_calls (killable processes)
    worker.py  the sandbox worker process that runs a tool call
The tools themselves and their registry are stages/tools.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import datasets

from runtime.phases import PHASES
from runtime.ray import map_row_shards
from schemas.features import (
    EXECUTE_TOOLS,
    FinishReason,
    StopReason,
    agent_state,
    agent_tool_call_id,
    dataset_from_rows,
)
from schemas.stage import POLICY, Inputs, Output, Settings, Stage, read
from schemas.token_stream import generation_prompt_ids, observation_token_ids
from stages.execute_tools.calls import (
    FAILURE_KINDS,
    ToolCall,
    ToolResult,
    parse_tool_calls,
    rejected_call,
    run_tool_calls,
)
from stages.policy.loading import load_tokenizer
from stages.registry import Tasks
from stages.tools import truncate


class ExecuteSettings(Settings):
    tasks: Tasks  # the environments step the rollouts, their tools answer the calls
    timeout_s: float = read("tools.timeout_s")
    max_output_chars: int = read("tools.max_output_chars")
    sandbox: bool = read("tools.sandbox")
    memory_mb: int = read("tools.memory_mb")
    malformed_call: str = read("tools.malformed_call")
    max_context_tokens: int = read("generation.max_context_tokens")
    enable_thinking: bool = read("generation.enable_thinking")
    max_workers: int = read("runner.max_workers", placement=True)  # rollouts whose calls run at once
    runner: str = read("runner.kind", placement=True)
    shards: int = read("runner.shards", placement=True)


def _step_turn(
    row: dict[str, Any],
    environment: Any,
    tools: dict[str, Callable[..., Any]],
    tokenizer: Any,
    settings: ExecuteSettings,
) -> dict[str, Any]:
    """Tools, observation and termination of one rollout turn (never raises)."""
    out: dict[str, Any] = {
        "tool_calls": [],
        "observation": "",
        "observation_token_ids": [],
        "next_stop": [],
        "next_env_state": row["env_state"],
        "turn_reward": 0.0,
        "terminated": False,
        "truncated": False,
        "stop_reason": None,
        "failed": bool(row["failed"]),
        "failure": row["failure"],
    }
    if row["failed"]:  # generation failed for this rollout: flagged, never scored
        return {**out, "stop_reason": StopReason.FAILED}
    recorded = agent_state(row["env_state"])
    if recorded is not None:  # an agent program's call: its tools ran in the agent, recorded
        return {**out, **agent_turn(row, recorded, tokenizer)}
    used = row["stream_offset"] + len(row["context_token_ids"]) + len(row["completion_token_ids"])  # context so far
    if row["finish_reason"] == FinishReason.LENGTH:  # cut mid-answer: nothing to execute
        # cut by the context budget (it left less than max_new_tokens), or by max_new_tokens
        full = used >= settings.max_context_tokens
        return {**out, "truncated": True, "stop_reason": StopReason.CONTEXT_OVERFLOW if full else StopReason.LENGTH}
    task = json.loads(row["task_payload"])
    calls = parse_tool_calls(row["content"])
    # tools.malformed_call=answer: a turn with a call the parser cannot read runs no call and is the turn of a
    # model that called nothing (a tool-using task's final answer), as TRL's GRPOTrainer reads it
    as_answer = settings.malformed_call == "answer" and any(call.error is not None for call in calls)
    runnable = [] if as_answer else calls
    results: list[ToolResult | None]
    if environment.runs_tool_calls:  # its tools act on its episode: step() runs the calls that are well formed
        schemas = {schema["function"]["name"]: schema for schema in environment.own_tool_schemas}
        results = [rejected_call(call, schemas) for call in runnable]
    else:
        own_tools = {name: tools[name] for name in environment.tools}  # an agent only has its task's tools
        results = run_tool_calls(
            runnable,
            own_tools,
            settings.timeout_s,
            settings.max_output_chars,
            task=task,
            sandbox=settings.sandbox,
            memory_mb=settings.memory_mb,
        )
    failure = None
    try:
        given = runnable
        if environment.runs_tool_calls:  # it runs the well-formed calls itself
            given = [call for call, result in zip(runnable, results) if result is None]
        step = environment.step(
            task,
            row["turn"],
            row["content"],
            [{"name": c.name, "arguments": c.arguments} for c in given],
            None if environment.runs_tool_calls else [r.content for r in results if r is not None],
            json.loads(row["env_state"]),
        )
        if environment.runs_tool_calls:
            results = episode_results(runnable, results, step.tool_results, settings.max_output_chars)
        next_env_state = row["env_state"] if step.state is None else json.dumps(step.state, sort_keys=True)
        observation = observation_token_ids(tokenizer, step.observation) if not step.done else []
    except Exception as exc:  # an environment bug fails this rollout, visibly, not the run
        failure = f"environment '{row['task']}' raised {exc.__class__.__name__}: {exc}"
    out["tool_calls"] = tool_call_rows(calls, results + [None] * (len(calls) - len(results)))  # unrun: no result
    crashed = [result.content for result in results if result is not None and result.error == "crashed"]
    if crashed:  # the tool's process died: an infrastructure failure, not the agent's
        failure = crashed[0]
    if failure is not None:
        return {**out, "failed": True, "failure": failure[:1000], "stop_reason": StopReason.FAILED}
    out.update(turn_reward=float(step.reward), next_env_state=next_env_state)
    if step.done:
        return {**out, "terminated": True, "stop_reason": StopReason.DONE}
    if row["turn"] + 1 >= environment.turn_limit(settings.tasks.max_turns):
        return {**out, "truncated": True, "stop_reason": StopReason.MAX_TURNS}
    if row["finish_reason"] == FinishReason.STOP_STRING:  # the turn was cut at a stop string: close it
        observation = [tokenizer.eos_token_id, *observation]
    next_prompt = generation_prompt_ids(tokenizer, settings.enable_thinking)
    if used + len(observation) + len(next_prompt) >= settings.max_context_tokens:
        return {**out, "truncated": True, "stop_reason": StopReason.CONTEXT_OVERFLOW}
    out["observation_token_ids"] = observation
    out["observation"] = tokenizer.decode(observation)
    out["next_stop"] = list(step.stop or [])
    return out


def agent_turn(row: dict[str, Any], recorded: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """What an agent did after its call (stages/generate_rollouts/agents): the tool calls the model
    wrote with the results the agent sent back for them, the tokens it added before its next call,
    and, after its last call, how the rollout ended."""
    results = {m.get("tool_call_id"): m.get("content", "") for m in recorded["added_messages"] if m["role"] == "tool"}
    calls = parse_tool_calls(row["content"])
    rollout_id, turn = row["rollout_id"], row["turn"]
    ids = [agent_tool_call_id(rollout_id, turn, number) for number in range(len(calls))]
    answered = [ToolResult(results[id_], None, call.id) if id_ in results else None for id_, call in zip(ids, calls)]
    out = {
        "tool_calls": tool_call_rows(calls, answered),
        "observation_token_ids": recorded["observation_token_ids"],
        "observation": tokenizer.decode(recorded["observation_token_ids"]),
    }
    end = recorded["end"]
    if end is None:
        return out
    stop = end["stop_reason"]
    failed = stop == StopReason.FAILED
    return {
        **out,
        "stop_reason": stop,
        "terminated": stop == StopReason.DONE,
        "truncated": stop in (StopReason.MAX_TURNS, StopReason.LENGTH),
        "failed": failed,
        "failure": end["failure"] if failed else None,
    }


def tool_call_rows(calls: list[ToolCall], results: list[ToolResult | None]) -> list[dict[str, Any]]:
    """The `tool_calls` column of a turn: each call with its result (none for calls an environment
    was to run when it failed first)."""
    return [
        {
            "id": call.id,
            "name": call.name,
            "arguments": json.dumps(call.arguments),
            "parse_error": call.error,
            "result": None if result is None else result.content,
            "failure_kind": None if result is None else result.error,
        }
        for call, result in zip(calls, results)
    ]


def episode_results(
    calls: list[ToolCall],
    rejected: list[ToolResult | None],
    ran: list[tuple[str, str | None]] | None,
    max_chars: int,
) -> list[ToolResult]:
    """Every call's result when the environment ran the accepted ones (`ran`, in their order)."""
    accepted = sum(result is None for result in rejected)
    if ran is None or len(ran) != accepted:
        raise ValueError(f"step() ran {accepted} tool call(s) but returned {0 if ran is None else len(ran)} result(s)")
    answers = iter(ran)
    results = []
    for call, rejection in zip(calls, rejected):
        if rejection is not None:
            results.append(rejection)
            continue
        content, error = next(answers)
        results.append(ToolResult(truncate(str(content), max_chars), error, call.id))
    return results


def execute_tools(
    turns: datasets.Dataset,
    tokenizer: Any,
    environments: dict[str, Any],
    tools: dict[str, Callable[..., Any]],
    settings: ExecuteSettings,
) -> datasets.Dataset:
    """Run the tool calls of one generate-rollouts round and decide which rollouts go on."""
    rows = list(turns)
    with ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="mtrl-turn") as pool:
        outputs = list(
            pool.map(lambda row: _step_turn(row, environments[row["task"]], tools, tokenizer, settings), rows)
        )
    return dataset_from_rows([{**row, **out} for row, out in zip(rows, outputs)], EXECUTE_TOOLS)


def execute_shard(turns: datasets.Dataset, policy_dir: str, settings: ExecuteSettings) -> datasets.Dataset:
    """execute-tools on some of a turn's rows (all of them, or one Ray shard), where they run (this
    process, or a Ray worker): the policy's tokenizer by path, the environments and tools of the tasks."""
    tokenizer, tasks = load_tokenizer(policy_dir), settings.tasks
    with PHASES.span("stage_compute"):  # the stage's own work, apart from reading and writing
        return execute_tools(turns, tokenizer, tasks.environments(), tasks.tools(), settings)


def active_rollouts(dataset: datasets.Dataset) -> int:
    """The rollouts of an executed turn that go on to the next turn (no stop reason yet)."""
    return sum(stop is None for stop in dataset["stop_reason"])


def turn_summary(dataset: datasets.Dataset, settings: ExecuteSettings) -> dict[str, Any]:
    """What the manifest of a turn records: its turn, rollouts still going on, why the others
    stopped, tool failures by kind and the tools the run's tasks may use."""
    stops = dataset["stop_reason"]
    return {
        "turn": dataset[0]["turn"] if len(dataset) else None,
        "active": active_rollouts(dataset),
        "stop_reasons": {stop: stops.count(stop) for stop in sorted(set(stops) - {None})},
        "tool_failures": failure_counts(dataset),
        "tools": sorted(settings.tasks.tools()),
    }


def failure_counts(dataset: datasets.Dataset) -> dict[str, int]:
    """Tool failures by kind over a dataset of turns (for manifests and metrics)."""
    counts = dict.fromkeys(FAILURE_KINDS, 0)
    for calls in dataset["tool_calls"]:
        for call in calls:
            if call["failure_kind"]:
                counts[call["failure_kind"]] += 1
    return counts


def run(inputs: Inputs, settings: ExecuteSettings) -> Output:
    """execute-tools on one turn's generate-rollouts version (its rows hold the environments' state
    so far: a stateful game is made again from it), with the tokenizer of the policy that
    generated it (input "policy")."""
    turns = inputs.load("generate-rollouts")
    dataset = map_row_shards(
        execute_shard, turns, settings.runner, settings.shards, str(inputs.folder(POLICY)), settings
    )
    return Output(dataset, turn_summary(dataset, settings))


STAGE = Stage(
    name="execute-tools",
    inputs=("generate-rollouts", POLICY),  # the turn; the policy that generated it (its tokenizer)
    features=EXECUTE_TOOLS,
    settings=ExecuteSettings,
    run=run,
    rerun_from="generate-rollouts",
    distributed=True,
)
