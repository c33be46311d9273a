"""Parsing Hermes tool calls and running tools: never raises, every failure has a kind."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from stages.execute_tools import TOOLS, ToolCall, calculate, parse_tool_calls, run_tool_calls


def test_parse_well_formed_calls_in_order():
    text = (
        '<think>\nsome <tool_call> talk\n</think>\n\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+2"}}'
        '\n</tool_call>\n<tool_call>{"name": "get_weather", "arguments": "{\\"location\\": \\"Paris\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text.split("</think>")[-1])
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculate", {"expression": "1+2"}, None),
        ("get_weather", {"location": "Paris"}, None),  # arguments given as a JSON string are decoded
    ]


def test_parse_reports_what_is_malformed():
    cases = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no 'name'",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "not valid JSON",
        '<tool_call>{"name": "f", "arguments": {}}': "unclosed",
    }
    for text, message in cases.items():
        (call,) = parse_tool_calls(text)
        assert call.error is not None and message in call.error, (text, call.error)
    assert parse_tool_calls("no calls here") == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(list('<>/{}[]":, abcnmetol_\\\n0') + ["<tool_call>", "</tool_call>", '"name"', '"arguments"'])
    ).map("".join)
)
def test_parse_never_raises_and_flags_every_malformed_call(text):
    for call in parse_tool_calls(text):
        assert isinstance(call, ToolCall)
        assert call.error is not None or (call.name and isinstance(call.arguments, dict))


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=2000).map(lambda b: b.decode("latin-1")))
def test_parse_survives_binary_garbage(text):
    parse_tool_calls(text)
    parse_tool_calls("<tool_call>" + text)


def test_calculator_is_arithmetic_only_and_bounded():
    assert calculate("12+7-3") == "16" and calculate(" (2+3)*4 ") == "20" and calculate("7/2") == "3.5"
    for injected in (
        "__import__('os').system('touch /tmp/pwned')",
        "().__class__.__bases__[0].__subclasses__()",
        "open('/etc/passwd').read()",
        "lambda: 1",
        "[x for x in range(10**9)]",
        "a+1",
    ):
        try:
            calculate(injected)
        except ValueError:
            continue
        raise AssertionError(f"calculate accepted {injected!r}")
    started = time.perf_counter()
    for huge in ("9**9**9**9", "10**10**10", "2**64", "9" * 199, "(" * 150 + "1" + ")" * 49):
        try:
            calculate(huge)
        except ValueError:
            pass
    assert time.perf_counter() - started < 1.0


def slow_tool(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


def failing_tool(x: int) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def test_each_failure_kind_and_the_timeout():
    tools = {**TOOLS, "slow_tool": slow_tool, "failing_tool": failing_tool}
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "2*21"}}</tool_call>'
        "<tool_call>{broken</tool_call>"
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expression": 5}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "failing_tool", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "slow_tool", "arguments": {"seconds": 30}}</tool_call>'
    )
    started = time.perf_counter()
    results = run_tool_calls(calls, tools, timeout_s=0.5)
    assert time.perf_counter() - started < 2.0
    assert [r.error for r in results] == [
        None,
        "malformed",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "raised",
        "timeout",
    ]
    assert results[0].content == "42" and "boom" in results[5].content and "timed out" in results[6].content


def test_parallel_calls_share_one_deadline():
    tools = {"slow_tool": slow_tool}
    calls = parse_tool_calls('<tool_call>{"name": "slow_tool", "arguments": {"seconds": 0.3}}</tool_call>' * 16)
    started = time.perf_counter()
    results = run_tool_calls(calls, tools, timeout_s=5)
    assert all(r.content == "woke up" for r in results)
    assert time.perf_counter() - started < 1.5  # concurrently, not 16 x 0.3 s


def test_tool_output_is_truncated_and_marked():
    def long_tool() -> str:
        """Long output."""
        return "x" * 5000

    (result,) = run_tool_calls([ToolCall("long_tool", {})], {"long_tool": long_tool}, 1.0, max_output_chars=100)
    assert result.content.startswith("x" * 100) and "[truncated 4900 characters]" in result.content
