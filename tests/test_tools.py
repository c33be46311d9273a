"""Parsing Hermes tool calls and running tools: never raises, every failure has a kind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil
import pytest
import toolbox
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.execute_tools import calls
from stages.execute_tools.calls import ToolCall, parse_tool_calls, run_tool_calls
from stages.tools import TOOLS, calculate, tool_schema


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
        "<tool_call>1</tool_call>": "JSON object",
        "<tool_call>[]</tool_call>": "tool call list is empty",
        '<tool_call>{"arguments": {}}</tool_call>': "no 'name'",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "not valid JSON",
        '<tool_call>{"name": "f", "arguments": {}}': "unclosed",
    }
    for text, message in cases.items():
        (call,) = parse_tool_calls(text)
        assert call.error is not None and message in call.error, (text, call.error)
    assert parse_tool_calls("no calls here") == []


def test_a_list_of_calls_in_one_block_runs_every_call():
    """SmolLM2 writes its calls as one JSON list in one block: each element is a call of its
    own, numbered on from the calls before it."""
    calls = parse_tool_calls(
        '<tool_call>[{"name": "calculate", "arguments": {"expression": "2*21"}}, '
        '{"name": "calculate", "arguments": "{\\"expression\\": \\"1+2\\"}"}]</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expression": "7-4"}}</tool_call>'
    )
    assert [(c.id, c.name, c.arguments, c.error) for c in calls] == [
        ("call_0", "calculate", {"expression": "2*21"}, None),
        ("call_1", "calculate", {"expression": "1+2"}, None),
        ("call_2", "calculate", {"expression": "7-4"}, None),
    ]
    results = run_tool_calls(calls, TOOLS, timeout_s=30)
    assert [(r.call_id, r.content, r.error) for r in results] == [
        ("call_0", "42", None),
        ("call_1", "3", None),
        ("call_2", "3", None),
    ]


def test_a_malformed_element_of_a_call_list_fails_alone():
    calls = parse_tool_calls(
        '<tool_call>[{"name": "calculate", "arguments": {"expression": "6*7"}}, {"arguments": {}}, '
        '[{"name": "calculate", "arguments": {"expression": "1"}}], "calculate", '
        '{"name": "calculate", "arguments": [1]}, {"name": "calculate", "arguments": {"expression": "1+1"}}]</tool_call>'
    )
    assert [c.id for c in calls] == [f"call_{i}" for i in range(6)]
    assert [c.error for c in calls] == [
        None,
        "tool call has no 'name' string",
        "tool call must be a JSON object with 'name' and 'arguments'",  # a nested list is not a call
        "tool call must be a JSON object with 'name' and 'arguments'",
        "'arguments' must be a JSON object",
        None,
    ]
    results = run_tool_calls(calls, TOOLS, timeout_s=30)
    assert [r.error for r in results] == [None, "malformed", "malformed", "malformed", "malformed", None]
    assert results[0].content == "42" and results[5].content == "2"
    assert results[2].content == "Error: tool call must be a JSON object with 'name' and 'arguments'"


def test_an_empty_call_list_is_one_malformed_call():
    (call,) = parse_tool_calls("<tool_call>[]</tool_call>")
    assert call.id == "call_0" and call.name == "" and call.arguments == {}
    assert call.error == "tool call list is empty: expected JSON objects with 'name' and 'arguments'"
    (result,) = run_tool_calls([call], TOOLS, timeout_s=30)
    assert result.error == "malformed" and result.content == f"Error: {call.error}"


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
    # Bounded work: an exponent is checked before the power is computed, every intermediate value
    # against MAX_ABS_RESULT, so a huge power is refused, never computed (which would not end).
    refused = {
        "9**9**9**9": "exponent 387420489 is larger than 64",
        "10**10**10": "exponent 10000000000 is larger than 64",
        "2**64": "result is out of range",
        "(" * 150 + "1" + ")" * 49: "not an arithmetic expression",
        "1" * 201: "at most 200 characters",
    }
    for huge, reason in refused.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            calculate(huge)
    assert calculate("9" * 199) == "9" * 199  # a literal is no work


TOOLS_UNDER_TEST = {
    **TOOLS,
    "slow_tool": toolbox.slow_tool,
    "barrier_tool": toolbox.barrier_tool,
    "failing_tool": toolbox.failing_tool,
    "spinning_tool": toolbox.spinning_tool,
    "memory_hog": toolbox.memory_hog,
    "crashing_tool": toolbox.crashing_tool,
    "long_tool": toolbox.long_tool,
    "segfaulting_tool": toolbox.segfaulting_tool,
    "chatty_tool": toolbox.chatty_tool,
}


def warm_up(workers: int) -> None:
    """Start tool workers outside the timed part (a worker's start is not the tool's time)."""
    run_tool_calls([ToolCall("slow_tool", {"seconds": 0}, None, f"w{i}") for i in range(workers)], TOOLS_UNDER_TEST, 60)


def test_each_failure_kind_and_the_timeout():
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "2*21"}}</tool_call>'
        "<tool_call>{broken</tool_call>"
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expression": 5}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "failing_tool", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "slow_tool", "arguments": {"seconds": 30}}</tool_call>'
        '<tool_call>{"name": "crashing_tool", "arguments": {}}</tool_call>'
    )
    warm_up(4)
    # the 30 s tool's worker is killed at the 5 s deadline: a "timeout" result, never "woke up". The
    # deadline is generous: the other calls must end before it on a slow machine too.
    results = run_tool_calls(calls, TOOLS_UNDER_TEST, timeout_s=5)
    assert [r.error for r in results] == [
        None,
        "malformed",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "raised",
        "timeout",
        "crashed",
    ]
    assert results[0].content == "42" and "boom" in results[5].content
    assert results[6].content == "Error: tool 'slow_tool' timed out after 5 s"


@pytest.mark.slow  # waits for its deadline
def test_a_spinning_tool_is_killed_in_time_and_its_worker_replaced():
    warm_up(2)
    idle = list(calls._POOL._idle)  # the workers the two calls take: the spinning one's is killed
    (spun, ok) = run_tool_calls(
        [ToolCall("spinning_tool", {}, None, "a"), ToolCall("calculate", {"expression": "1+1"}, None, "b")],
        TOOLS_UNDER_TEST,
        timeout_s=5,  # generous: the calculation must end before it on a slow machine too
    )
    assert (spun.error, ok.content) == ("timeout", "2")
    assert spun.content == "Error: tool 'spinning_tool' timed out after 5 s"
    assert len(idle) >= 2 and sum(not worker.alive() for worker in idle) == 1  # killed at the deadline
    (again,) = run_tool_calls([ToolCall("calculate", {"expression": "2+2"}, None, "c")], TOOLS_UNDER_TEST, 30)
    assert again.content == "4"


def test_a_tool_that_allocates_too_much_memory_gets_an_error():
    (result,) = run_tool_calls(
        [ToolCall("memory_hog", {"megabytes": 4096}, None, "m")], TOOLS_UNDER_TEST, 30, memory_mb=256
    )
    assert result.error == "raised" and "MemoryError" in result.content
    (small,) = run_tool_calls(
        [ToolCall("memory_hog", {"megabytes": 64}, None, "m")], TOOLS_UNDER_TEST, 30, memory_mb=256
    )
    assert small.content == str(64 * 2**20)


def test_16_parallel_calls_share_one_deadline(tmp_path):
    # Each call waits at a barrier until all 16 have arrived: one after the other (or fewer at a
    # time) the first never returns and every call times out at the deadline they share; run
    # concurrently, every one answers, however slow the machine (the deadline is generous).
    arrivals = tmp_path / "arrivals"
    arrivals.mkdir()
    calls = [ToolCall("barrier_tool", {"directory": str(arrivals), "parties": 16}, None, f"c{i}") for i in range(16)]
    warm_up(16)
    results = run_tool_calls(calls, TOOLS_UNDER_TEST, timeout_s=60)
    assert [(r.content, r.error) for r in results] == [("16 arrived", None)] * 16
    assert len(list(arrivals.iterdir())) == 16


def test_tool_output_is_truncated_and_marked():
    (result,) = run_tool_calls([ToolCall("long_tool", {})], TOOLS_UNDER_TEST, 10.0, max_output_chars=100)
    assert result.content == "x" * 100 + "... [truncated 4900 characters]"


def test_the_task_is_injected_into_tools_that_take_it():
    (result,) = run_tool_calls([ToolCall("guess", {"number": 40})], TOOLS, 10.0, task={"secret": 57})
    assert result.content == "higher"
    assert "task" not in tool_schema(TOOLS["guess"])["function"]["parameters"]["properties"]


def test_a_crashed_worker_reports_how_it_ended_and_the_end_of_its_stderr():
    (chatty, crashed) = run_tool_calls(
        [ToolCall("chatty_tool", {"megabytes": 4}, None, "a"), ToolCall("segfaulting_tool", {}, None, "b")],
        TOOLS_UNDER_TEST,
        30,
    )
    assert chatty.content == "done"  # megabytes of stderr do not block a worker
    assert crashed.error == "crashed" and "signal SIGSEGV" in crashed.content
    assert "loading libfoo" in crashed.content  # what the tool printed
    assert "Segmentation fault" in crashed.content and "toolbox.py" in crashed.content  # the Python traceback


def test_a_worker_that_cannot_start_reports_the_end_of_its_stderr(tmp_path, monkeypatch):
    broken = tmp_path / "worker.py"
    broken.write_text("import sys\nsys.exit('cannot start: libfoo.so is missing')\n")
    monkeypatch.setattr(calls, "WORKER_SCRIPT", broken)
    # No idle worker to reuse: a worker's memory limit is set when it starts, so a limit no other
    # call used starts a new worker (from the broken script, which the message below proves ran).
    (result,) = run_tool_calls([ToolCall("slow_tool", {"seconds": 0})], TOOLS_UNDER_TEST, 30, memory_mb=509)
    assert result.error == "crashed" and "no worker process could start" in result.content
    assert "exit code 1" in result.content and "libfoo.so is missing" in result.content


def test_a_tool_a_worker_cannot_import_is_refused_by_the_sandbox_and_runs_in_a_thread_without_it():
    def local_tool(x: int) -> str:
        """A closure.

        Args:
            x: a number
        """
        return str(x * 2)

    call, tools = ToolCall("local_tool", {"x": 21}), {"local_tool": local_tool}
    with pytest.raises(ValueError, match="tool 'local_tool' cannot run in a sandbox worker") as refused:
        run_tool_calls([call], tools, 5.0)
    assert "module-level function" in str(refused.value) and "tools.sandbox: false" in str(refused.value)
    (result,) = run_tool_calls([call], tools, 5.0, sandbox=False)
    assert result.content == "42"


call_lists = st.lists(
    st.builds(
        ToolCall,
        name=st.sampled_from(["calculate", "guess", "nope", ""]),
        arguments=st.dictionaries(
            st.sampled_from(["expression", "number", "task", "x"]),
            st.one_of(
                st.integers(), st.text(max_size=20), st.none(), st.booleans(), st.lists(st.integers(), max_size=2)
            ),
            max_size=3,
        ),
        error=st.one_of(st.none(), st.just("broken")),
        id=st.text(max_size=4),
    ),
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(call_lists)
def test_run_tool_calls_never_raises_and_flags_every_failure(calls):
    results = run_tool_calls(calls, TOOLS, timeout_s=10.0, task={"secret": 3})
    assert len(results) == len(calls)
    for call, result in zip(calls, results):
        assert isinstance(result.content, str)
        if call.error is not None:
            assert result.error == "malformed"
        elif call.name not in TOOLS:
            assert result.error == "unknown_tool"
        if result.error is None:
            assert not result.content.startswith("Error")


def test_the_python_tool_runs_a_program_in_a_limited_process_and_returns_what_it_printed():
    programs = {
        "print(sum(range(1, 11)))": ("55", None),
        "import os\nprint('HOME' in os.environ, 'PYTHONPATH' in os.environ)": ("False False", None),  # not ours
        "raise ValueError('bad input')": ("ValueError: bad input\n(exit status 1)", None),
        "x = bytearray(2 * 1024**3)": ("MemoryError\n(exit status 1)", None),
        "pass": ("(no output)", None),
    }
    calls = [ToolCall("python", {"code": code}, None, f"call_{i}") for i, code in enumerate(programs)]
    results = run_tool_calls(calls, TOOLS, timeout_s=60)
    for result, (code, (ending, error)) in zip(results, programs.items()):
        assert result.content.endswith(ending) and result.error == error, (code, result)


@pytest.mark.slow  # waits for its deadline (test_each_failure_kind_and_the_timeout times one out in the fast loop)
def test_a_python_program_that_never_ends_is_killed_at_the_tool_deadline(tmp_path):
    """The program writes its pid and folder, then spins: its worker is killed at the deadline, and the
    program dies with it; the folder the killed worker left is removed by the next call."""
    pid_file = tmp_path / "pid"
    code = f"import os\nopen({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{os.getcwd()}}')\nwhile True:\n    pass"
    (result,) = run_tool_calls([ToolCall("python", {"code": code})], TOOLS, timeout_s=3)
    assert result.error == "timeout"
    pid, folder = pid_file.read_text().split(" ", 1)
    try:
        psutil.Process(int(pid)).wait(timeout=10)  # TimeoutExpired: it outlived its worker
    except psutil.NoSuchProcess:
        pass  # gone already
    assert Path(folder).is_dir()  # its worker was killed before it could remove it
    (result,) = run_tool_calls([ToolCall("python", {"code": "print(6 * 7)"})], TOOLS, timeout_s=30)
    assert result.content == "42" and not Path(folder).exists()


def generated_turn(task_name: str, task: dict, content: str) -> dict:
    """A generate-rollouts row of a rollout's first turn that wrote `content`, for execute_tools."""
    return {
        "rollout_id": 0,
        "task": task_name,
        "task_payload": json.dumps(task),
        "env_state": "{}",
        "turn": 0,
        "stream_offset": 0,
        "context_token_ids": [1],
        "completion_token_ids": [2],
        "finish_reason": "stop",
        "content": content,
        "failed": False,
    }


@pytest.mark.parametrize("malformed_call", ["error", "answer"])
def test_a_turn_with_a_malformed_call_goes_on_with_its_error_or_is_the_final_answer(malformed_call, tiny):
    """tools.malformed_call: `error` answers every call of the turn and the rollout goes on; `answer`
    runs none and ends a tool-using task's rollout on that turn, as TRL's GRPOTrainer reads it."""
    from schemas.config import RunConfig
    from schemas.features import GENERATE_ROLLOUTS, StopReason, dataset_from_rows
    from stages.environments import ENVIRONMENTS
    from stages.execute_tools import ExecuteSettings, execute_tools

    task = {"question": "What is 2+3-1?", "expression": "2+3-1", "answer": 4}
    content = (
        '<tool_call>{"name": "calculate", "arguments": {"expression": "2+3"}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expression": "5-1"</tool_call> so 4'
    )
    row = generated_turn("calculator", task, content)
    config = RunConfig(task={"name": "calculator"}, tools={"sandbox": False, "malformed_call": malformed_call})
    environments = {"calculator": ENVIRONMENTS["calculator"]}
    (turn,) = execute_tools(
        dataset_from_rows([row], GENERATE_ROLLOUTS), tiny[1], environments, TOOLS, ExecuteSettings.resolve(config)
    )
    assert [call["parse_error"] is None for call in turn["tool_calls"]] == [True, False]
    if malformed_call == "error":
        assert [call["result"] for call in turn["tool_calls"]][0] == "5"
        assert turn["tool_calls"][1]["failure_kind"] == "malformed" and turn["stop_reason"] is None
        assert "5" in turn["observation"] and "not valid JSON" in turn["observation"]
    else:
        assert [call["result"] for call in turn["tool_calls"]] == [None, None]  # nothing ran
        assert turn["stop_reason"] == StopReason.DONE and turn["terminated"] and turn["observation_token_ids"] == []
        assert environments["calculator"].reward(task, turn) == 1.0  # its text is the answer: "... so 4"
