"""OpenEnv environments (stages/ecosystem/openenv.py) with the real package (openenv-core): a text
environment and an MCPEnvironment in this process, and a text environment served over HTTP by
the test; every step is made again from the seed and the stored actions, so a turn re-runs to the
same bytes in another process; an environment that does not repeat itself fails, named."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_tools import generated_turn

from pipeline.store.versions import Store
from runtime.processes import free_port
from schemas.config import RunConfig
from schemas.features import GENERATE_ROLLOUTS, dataset_from_rows
from stages.environments import ReplayError
from stages.execute_tools import ExecuteSettings, execute_tools
from stages.registry import Tasks, check_tasks

ROOT = Path(__file__).resolve().parent.parent
GUESS, CALC = "openenv/guess", "openenv/calc"
IN_PROCESS = {
    GUESS: {"environment": "openenv_envs.GuessEnvironment"},
    CALC: {"environment": "openenv_envs.CalculatorToolEnvironment"},
}


def adapter(name: str, options: dict | None = None):
    return Tasks.resolve(RunConfig(task={"name": name, "options": {name: options or IN_PROCESS[name]}})).environment(
        name
    )


def bisect(env, task: dict) -> tuple[list, list[int]]:
    """Find the number, one reply a turn; the adapter's EnvSteps and the guesses."""
    low, high, state, steps, guesses = 1, 20, {}, [], []
    while not steps or not steps[-1].done:
        guesses.append((low + high) // 2)
        steps.append(env.step(task, len(steps), f"I guess {guesses[-1]}.", [], [], state))
        state = steps[-1].state
        feedback = steps[-1].observation[0]["content"] if steps[-1].observation else ""
        low, high = (guesses[-1] + 1, high) if feedback == "higher" else (low, guesses[-1] - 1)
    return steps, guesses


def test_a_text_environment_is_played_one_action_a_turn_and_replayed_from_its_seed():
    env = adapter(GUESS)
    assert env.action_field == "guess" and env.tools == () and not env.runs_tool_calls
    task = env.sample_task(random.Random(0))
    assert task["question"] == "I am thinking of a number between 1 and 20. Guess it."
    steps, guesses = bisect(env, task)
    assert all(step.observation[0]["content"] in ("higher", "lower") for step in steps[:-1])
    final = steps[-1].state
    assert final["actions"] == [{"guess": f"I guess {guess}."} for guess in guesses] and len(guesses) <= 5
    assert env.reward(task, {"next_env_state": json.dumps(final)}) == 1.0
    # a stored observation the environment does not give again: the rollout fails, never diverges
    tampered = {**steps[0].state, "observations": ["f" * 16]}
    with pytest.raises(ReplayError, match="did not answer action 0 as it did the first time"):
        env.step(task, 1, "I guess 3.", [], [], tampered)


def test_an_mcp_environments_tools_run_inside_its_episode():
    env = adapter(CALC)
    assert env.tools == ("calculate", "submit") and env.runs_tool_calls and env.action_field is None
    task = env.sample_task(random.Random(0))
    a, b = (int(term) for term in task["question"].removeprefix("What is ").split("?")[0].split("+"))
    # through execute-tools: a call that is well formed runs in the episode; the others never reach it
    content = (
        f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": {"expression": 12}}</tool_call>'
        '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'
    )
    row = generated_turn(CALC, task, content)
    from pipeline.models.base_model import EMBEDDED_POLICY
    from stages.policy.loading import load_tokenizer

    config = RunConfig(task={"name": CALC, "options": {CALC: IN_PROCESS[CALC]}})
    turn = execute_tools(
        dataset_from_rows([row], GENERATE_ROLLOUTS),
        load_tokenizer(EMBEDDED_POLICY),
        {CALC: env},
        {},
        ExecuteSettings.resolve(config),
    )[0]
    assert [(call["result"], call["failure_kind"]) for call in turn["tool_calls"]] == [
        (str(a + b), None),
        ("Error: argument 'expression' must be of type string, got int", "bad_arguments"),
        ("Error: unknown tool 'teleport'; available: calculate, submit", "unknown_tool"),
    ]
    state = json.loads(turn["next_env_state"])
    assert state["actions"] == [
        {"type": "call_tool", "tool_name": "calculate", "arguments": {"expression": f"{a}+{b}"}}
    ]
    assert str(a + b) in turn["observation"] and turn["stop_reason"] is None
    submitted = env.step(task, 1, "", [{"name": "submit", "arguments": {"answer": a + b}}], None, state)
    assert submitted.done and submitted.tool_results == [("submitted", None)]
    assert env.reward(task, {"next_env_state": json.dumps(submitted.state)}) == 1.0
    answered = env.step(task, 1, f"It is {a + b}.", [], None, state)  # no text action: the final answer
    assert answered.done and answered.state["reward"] == 0.0


def test_a_bad_openenv_setting_is_refused_at_run_start():
    refused = {
        "neither": ({}, "give exactly one of 'environment'"),
        "class": ({"environment": "openenv_envs.NoSuchEnvironment"}, "cannot import the OpenEnv environment class"),
        "option": ({"environment": "openenv_envs.GuessEnvironment", "speed": 2}, r"unknown option\(s\) \['speed'\]"),
        "down": ({"url": f"http://127.0.0.1:{free_port()}"}, "failed to start a task|Failed to connect"),
    }
    for label, (options, message) in refused.items():
        name = f"openenv/{label}"
        with pytest.raises(ValueError, match=message):
            check_tasks(Tasks.resolve(RunConfig(task={"name": name, "options": {name: options}})), sandbox=True)


@pytest.fixture(scope="module")
def served_guess():
    """The text environment served over HTTP by OpenEnv's own server, as a user serves one."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.openenv_envs:guess_app", "--host", "127.0.0.1"]
    server = subprocess.Popen([*command, "--port", str(port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).close()
            return True
        except OSError:
            return False

    # Wait for the server's own outcome: it answers, or it exits. (The bound only keeps a server that
    # does neither from hanging the suite; it is no claim on how fast it starts.)
    waited_until = time.monotonic() + 600
    while not answers() and server.poll() is None and time.monotonic() < waited_until:
        time.sleep(0.2)
    assert server.poll() is None, f"the environment server exited with {server.returncode} before it answered"
    assert answers(), "the environment server neither answered nor exited"
    yield url
    server.terminate()
    server.wait(timeout=30)


@pytest.mark.slow  # a uvicorn process of its own
def test_the_served_environment_answers_as_the_one_in_process(served_guess):
    here, there = adapter(GUESS), adapter(GUESS, {"url": served_guess})
    assert there.action_field == "guess" and there.identity()["action_schema"] == here.identity()["action_schema"]
    task = there.sample_task(random.Random(3))
    assert here.sample_task(random.Random(3)) == task
    assert [step.observation for step in bisect(there, task)[0]] == [step.observation for step in bisect(here, task)[0]]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_one_iteration_on_a_served_environment_and_a_turn_re_runs_to_the_same_bytes_elsewhere(served_guess, tmp_path):
    from rerun import rerun_turn_elsewhere

    from pipeline.orchestration.flows import rl_training

    config = RunConfig(
        iterations=1,
        task={
            "name": GUESS,
            "rollouts": 16,
            "group_size": 4,
            "max_turns": 3,
            "options": {GUESS: {"url": served_guess}},
        },
        generation={"max_new_tokens": 64},  # room for a reply to end: the episode goes on
        ppo={"minibatch_rollouts": 4},
        store={"runs_dir": tmp_path / "runs"},
    )
    (result,) = rl_training(config)
    store = Store(config.store.runs_dir)
    rewarded = store.load("assign-rewards", result["versions"]["assign-rewards"]).to_list()
    assert {row["task"] for row in rewarded} == {GUESS}
    assert not any(row["failed"] for row in rewarded), [row["failure"] for row in rewarded if row["failed"]]
    later = [row for row in rewarded if row["turn"] >= 1]
    assert later and all(json.loads(row["env_state"])["actions"] for row in later)
    for row in rewarded:
        if row["stop_reason"] == "done":
            assert row["reward"] == json.loads(row["next_env_state"])["reward"]
    lines, different = rerun_turn_elsewhere(store.root, result["versions"]["execute-tools"][1], tmp_path)
    assert different == 0, "\n".join(lines)
