"""execute-tools: parse the Hermes tool calls of each assistant turn, run them, and append
the tool/environment observation to the rollout as exact chat-template delta tokens.

Reads one generate-rollouts round; writes one dataset row per rollout turn with everything
known about that turn (generation columns + tool calls + observation + termination).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import datasets
from transformers.utils import get_json_schema

from schemas.config import GenerationConfig, TaskConfig, ToolsConfig
from schemas.features import EXECUTE_TOOLS, dataset_from_rows
from schemas.token_stream import generation_prompt_ids, observation_token_ids

# ---------------------------------------------------------------------------------------
# Tools: typed Python functions; their JSON schema comes from the signature and docstring.
# ---------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_ABS_RESULT = 10**15  # bounded work: larger intermediate values are an error, not a hang
MAX_EXPONENT = 64

_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _arithmetic(node: ast.AST) -> int | float:
    """Evaluate a parsed arithmetic expression tree; anything but numbers and operators is refused."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY_OPS[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_ABS_RESULT:
            raise ValueError("result is out of range")
        return value
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression to evaluate, for example "12+7-3".
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        # ast.parse only parses; _arithmetic walks the tree and never executes code.
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an arithmetic expression: {exc.__class__.__name__}") from None
    try:
        value = _arithmetic(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except RecursionError:
        raise ValueError("expression is nested too deeply") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


TOOLS: dict[str, Callable[..., Any]] = {"calculate": calculate}


@functools.cache
def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema the chat template shows the model, from the signature and docstring
    (OpenAI's function format: the "return" entry transformers adds is not part of it)."""
    schema = get_json_schema(tool)
    schema["function"].pop("return", None)
    return schema


# ---------------------------------------------------------------------------------------
# Parsing: Hermes/Qwen3 <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks.
# ---------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # None, or what is malformed about this call
    id: str = ""


@dataclass
class ToolResult:
    content: str  # what goes into <tool_response>
    error: str | None = None  # None, or the failure kind: one of FAILURE_KINDS
    call_id: str = ""


FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _parse_one(body: str, closed: bool, index: int) -> ToolCall:
    call_id = f"call_{index}"
    if not closed:
        return ToolCall("", {}, "unclosed <tool_call> block", call_id)
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCall("", {}, f"tool call is not valid JSON: {str(exc)[:200]}", call_id)
    if not isinstance(payload, dict):
        return ToolCall("", {}, "tool call must be a JSON object with 'name' and 'arguments'", call_id)
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "tool call has no 'name' string", call_id)
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCall(name, {}, "'arguments' is a string but not valid JSON", call_id)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, "'arguments' must be a JSON object", call_id)
    return ToolCall(name, arguments, None, call_id)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of an assistant message, in order. Never raises."""
    if not isinstance(text, str):
        return [ToolCall("", {}, "assistant message is not text", "call_0")]
    return [
        _parse_one(match.group(1), match.group(2) == "</tool_call>", index)
        for index, match in enumerate(_CALL_BLOCK.finditer(text))
    ]


# ---------------------------------------------------------------------------------------
# Execution: validate arguments against the schema, run calls concurrently with a timeout.
# ---------------------------------------------------------------------------------------

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def validate_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A message the model can read if the arguments do not fit the schema, else None."""
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties)}"
    for name, value in arguments.items():
        expected = properties[name].get("type")
        allowed = _JSON_TYPES.get(expected, (object,)) if isinstance(expected, str) else (object,)
        if isinstance(value, bool) and expected in ("integer", "number"):
            allowed = ()
        if not isinstance(value, allowed):
            return f"argument '{name}' must be of type {expected}, got {type(value).__name__}"
        if "enum" in properties[name] and value not in properties[name]["enum"]:
            return f"argument '{name}' must be one of {properties[name]['enum']}"
    return None


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [truncated {len(text) - max_chars} characters]"


def _check(call: ToolCall, tools: dict[str, Callable[..., Any]]) -> ToolResult | None:
    """The error result of a call that must not run at all, else None."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}", "malformed", call.id)
    if call.name not in tools:
        return ToolResult(f"Error: unknown tool '{call.name}'; available: {', '.join(tools)}", "unknown_tool", call.id)
    problem = validate_arguments(tool_schema(tools[call.name]), call.arguments)
    if problem is not None:
        return ToolResult(f"Error: {problem}", "bad_arguments", call.id)
    return None


def _run_one(call: ToolCall, tool: Callable[..., Any]) -> ToolResult:
    try:
        return ToolResult(str(tool(**call.arguments)), None, call.id)
    except Exception as exc:  # a tool that raises gives the model an error message, not a crash
        return ToolResult(f"Error: {exc.__class__.__name__}: {exc}", "raised", call.id)


def run_tool_calls(
    calls: list[ToolCall],
    tools: dict[str, Callable[..., Any]],
    timeout_s: float,
    max_output_chars: int = 2000,
) -> list[ToolResult]:
    """Run the calls of one message concurrently. Never raises; failures become error results."""
    rejected = [_check(call, tools) for call in calls]
    runnable = [call for call, rejection in zip(calls, rejected) if rejection is None]
    pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(runnable))), thread_name_prefix="mtrl-tool")
    futures = {call.id: pool.submit(_run_one, call, tools[call.name]) for call in runnable}
    deadline = time.monotonic() + timeout_s  # the calls run concurrently: one shared deadline
    results = []
    for call, rejection in zip(calls, rejected):
        result = rejection
        if result is None:
            try:
                result = futures[call.id].result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                result = ToolResult(f"Error: tool '{call.name}' timed out after {timeout_s:g} s", "timeout", call.id)
        results.append(ToolResult(_truncate(result.content, max_output_chars), result.error, call.id))
    pool.shutdown(wait=False, cancel_futures=True)  # a hung thread is abandoned, not joined
    return results


# ---------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------


def _step_turn(
    row: dict[str, Any],
    environment: Any,
    tools: dict[str, Callable[..., Any]],
    tokenizer: Any,
    task_config: TaskConfig,
    tools_config: ToolsConfig,
    generation_config: GenerationConfig,
) -> dict[str, Any]:
    """Tools, observation and termination of one rollout turn (never raises)."""
    out: dict[str, Any] = {
        "tool_calls": [],
        "observation": "",
        "observation_token_ids": [],
        "turn_reward": 0.0,
        "terminated": False,
        "truncated": False,
        "stop_reason": None,
        "failed": False,
        "failure": None,
    }
    if row["finish_reason"] == "length":  # cut mid-answer: nothing to execute
        return {**out, "truncated": True, "stop_reason": "length"}
    calls = parse_tool_calls(row["content"])
    results = run_tool_calls(calls, tools, tools_config.timeout_s, tools_config.max_output_chars)
    out["tool_calls"] = [
        {
            "id": call.id,
            "name": call.name,
            "arguments": json.dumps(call.arguments),
            "parse_error": call.error,
            "result": result.content,
            "failure_kind": result.error,
        }
        for call, result in zip(calls, results)
    ]
    task = json.loads(row["task_payload"])
    try:
        step = environment.step(
            task,
            row["turn"],
            row["content"],
            [{"name": c.name, "arguments": c.arguments} for c in calls],
            [r.content for r in results],
        )
        observation = observation_token_ids(tokenizer, step.observation) if not step.done else []
    except Exception as exc:  # an environment bug fails this rollout, visibly, not the run
        failure = f"environment '{row['task']}' raised {exc.__class__.__name__}: {exc}"
        return {**out, "failed": True, "failure": failure[:1000], "stop_reason": "failed"}
    out["turn_reward"] = float(step.reward)
    if step.done:
        return {**out, "terminated": True, "stop_reason": "done"}
    if row["turn"] + 1 >= task_config.max_turns:
        return {**out, "truncated": True, "stop_reason": "max_turns"}
    next_prompt = generation_prompt_ids(tokenizer, generation_config.enable_thinking)
    used = row["stream_offset"] + len(row["context_token_ids"]) + len(row["completion_token_ids"])
    if used + len(observation) + len(next_prompt) >= generation_config.max_context_tokens:
        return {**out, "truncated": True, "stop_reason": "context_overflow"}
    out["observation_token_ids"] = observation
    out["observation"] = tokenizer.decode(observation)
    return out


def execute_tools(
    turns: datasets.Dataset,
    tokenizer: Any,
    environments: dict[str, Any],
    tools: dict[str, Callable[..., Any]],
    *,
    task_config: TaskConfig,
    tools_config: ToolsConfig,
    generation_config: GenerationConfig,
    max_workers: int = 8,
) -> datasets.Dataset:
    """Run the tool calls of one generate-rollouts round and decide which rollouts go on."""
    rows = list(turns)
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="mtrl-turn") as pool:
        outputs = list(
            pool.map(
                lambda row: _step_turn(
                    row, environments[row["task"]], tools, tokenizer, task_config, tools_config, generation_config
                ),
                rows,
            )
        )
    return dataset_from_rows([{**row, **out} for row, out in zip(rows, outputs)], EXECUTE_TOOLS)


def failure_counts(dataset: datasets.Dataset) -> dict[str, int]:
    """Tool failures by kind over a dataset of turns (for manifests and metrics)."""
    counts = dict.fromkeys(FAILURE_KINDS, 0)
    for calls in dataset["tool_calls"]:
        for call in calls:
            if call["failure_kind"]:
                counts[call["failure_kind"]] += 1
    return counts
