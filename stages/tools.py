"""The tool registry, the JSON schema of a tool, and the built-in tools.

A tool is a typed Python function with a Google-style docstring; the JSON schema the model
sees is derived from its signature and docstring (`transformers.utils.get_json_schema`). A
parameter named `task` is not shown to the model: execute-tools passes the rollout's task
(its hidden state, e.g. the number to guess) into it. Generation renders the schemas into the
prompt (stages/generate_rollouts: rollout_starts); execute-tools runs the calls (stages/execute_tools/).

Tools run in a separate, killable worker process by default (stages/execute_tools/calls.py),
which loads a tool's module from its file: keep tool modules light (this one imports only the
standard library at import time) and tools module-level functions; results are converted with str().
A RemoteTool (an MCP server's) runs in its server instead.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import sys
from collections.abc import Callable
from typing import Any

from stages.python_tool import python

INJECTED_PARAMETERS = ("task",)  # filled in by execute-tools, never by the model

# ----------------------------------------------------------------------------- calculate

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


# ----------------------------------------------------------------------------- get_weather


def get_weather(location: str, task: dict, unit: str = "celsius") -> str:
    """Get the current temperature of a city.

    Args:
        location: The city name, for example "Paris".
        task: The episode's weather (filled in by the environment, not by the model).
        unit: The temperature unit, "celsius" or "fahrenheit".
    """
    weather = {city.lower(): degrees for city, degrees in task["weather"].items()}
    if location.strip().lower() not in weather:
        raise ValueError(f"unknown city '{location}'; known: {', '.join(task['weather'])}")
    celsius = weather[location.strip().lower()]
    if unit == "fahrenheit":
        return f"{round(celsius * 9 / 5 + 32)} F"
    if unit != "celsius":
        raise ValueError("unit must be 'celsius' or 'fahrenheit'")
    return f"{celsius} C"


# ----------------------------------------------------------------------------- guess


def guess(number: int, task: dict) -> str:
    """Guess the hidden number; the answer is higher, lower or correct.

    Args:
        number: Your guess.
        task: The episode's hidden state (filled in by the environment, not by the model).
    """
    if number < task["secret"]:
        return "higher"
    if number > task["secret"]:
        return "lower"
    return "correct"


TOOLS: dict[str, Callable[..., Any]] = {
    "calculate": calculate,
    "get_weather": get_weather,
    "guess": guess,
    "python": python,  # stages/python_tool.py: the program runs in a limited child process
}


# ----------------------------------------------------------------------------- a tool's output


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` (tools.max_output_chars), the cut marked for the model."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [truncated {len(text) - max_chars} characters]"


# ----------------------------------------------------------------------------- tools served by another process


class RemoteTool:
    """A tool that runs in a server, not as a Python function of ours: an MCP server's tool
    (stages/ecosystem/mcp.py). It brings its JSON schema, what identifies it (hashed into the
    versions of the stages it shapes, as a function's source file is), and its own transport,
    with the same guarantees as a sandboxed call: a deadline, an output cap, errors as results."""

    schema: dict[str, Any]  # OpenAI's function format, as tool_schema returns
    identity: dict[str, Any]  # JSON: what a version must change with (server, version, schema, client code)
    start_timeout_s: float  # a call may first wait this long for its server to be ready

    def call(self, arguments: dict[str, Any], timeout_s: float, max_chars: int) -> tuple[str, str | None]:
        """(content for the model, None or a failure kind of FAILURE_KINDS); never raises."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- what mtrl reads of a tool


@functools.cache
def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema the chat template shows the model (OpenAI's function format), from the
    signature and docstring; injected parameters and transformers' "return" entry are left out.
    A RemoteTool brings its own."""
    if isinstance(tool, RemoteTool):
        return tool.schema
    from transformers.utils import get_json_schema  # heavy: not imported by sandbox workers

    schema = get_json_schema(tool)
    function = schema["function"]
    function.pop("return", None)
    parameters = function.get("parameters", {})
    for name in INJECTED_PARAMETERS:
        parameters.get("properties", {}).pop(name, None)
        if name in parameters.get("required", []):
            parameters["required"].remove(name)
    return schema


NOT_SANDBOXABLE = (
    "cannot run in a sandbox worker, which imports a tool by module and name (a lambda, a closure, "
    "a method or a function of __main__ cannot be): move it to a module-level function of an importable "
    "module, or set tools.sandbox: false to run tools in threads, with no kill at the deadline and no memory limit"
)


def importable_by_name(tool: Callable[..., Any]) -> bool:
    """Can a sandbox worker import this tool by module and name (a module-level function of a
    module other than __main__)?"""
    module = sys.modules.get(getattr(tool, "__module__", None) or "")
    target = module
    for part in getattr(tool, "__qualname__", "<lambda>").split("."):
        target = getattr(target, part, None)
    return module is not None and module.__name__ != "__main__" and target is tool
