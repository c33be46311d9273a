"""Environments: the built-in tasks, task mixes, per-turn rewards, stop strings, failures."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from pipeline.orchestration.episodes import run_episodes
from schemas.config import RunConfig, TaskConfig
from schemas.features import ASSIGN_REWARDS, EXECUTE_TOOLS, dataset_from_rows
from schemas.task_mix import groups_per_task, parse_task_mix
from schemas.token_stream import prompt_token_ids
from stages.assign_rewards import RewardSettings, assign_rewards, rollout_metrics
from stages.environments import ENVIRONMENTS, CalculatorEnv, GuessNumberEnv, WeatherEnv
from stages.execute_tools.calls import ToolCall, run_tool_calls
from stages.generate_rollouts import GenerateSettings
from stages.generate_rollouts import rollout_starts as starts_of
from stages.generate_rollouts.hf import HFEngine
from stages.policy.loading import eos_token_ids
from stages.registry import Tasks
from stages.tools import TOOLS, tool_schema


def guess(number: int) -> dict:
    return {"name": "guess", "arguments": {"number": number}}


def test_guess_number_ends_at_the_correct_guess_and_pays_for_speed():
    env = GuessNumberEnv()
    task = {"question": "?", "secret": 37}
    first = env.step(task, 0, "", [guess(20)], ["higher"], {})
    # the answer states the interval that can still hold the number: the observation is Markov
    assert first.observation == [{"role": "tool", "content": "higher: between 21 and 100, middle 60"}]
    assert not first.done
    assert first.state == {"low": 21, "high": 100}
    assert env.step(task, 3, "", [guess(37)], ["correct"], first.state).done
    gave_up = env.step(task, 4, "I give up.", [], [], first.state)  # a turn without a guess ends the game
    assert gave_up.done and gave_up.observation == [] and gave_up.state == first.state and gave_up.reward == 0.0
    assert env.reward(task, {"turn": 4, "tool_calls": []}) == 0.0  # unsolved
    solved_fast = {"turn": 0, "tool_calls": [{"result": "correct"}]}
    solved_slow = {"turn": 9, "tool_calls": [{"result": "correct"}]}
    assert env.reward(task, solved_fast) == 1.0 > env.reward(task, solved_slow) == pytest.approx(0.82)  # 1 - 9/50
    assert env.reward(task, {"turn": 2, "tool_calls": [{"result": "lower"}]}) == 0.0
    # the demonstration is a binary search that ends with the correct guess
    demo = env.demonstration(task)
    guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in demo if m["role"] == "assistant"]
    assert guesses[0] == 50 and guesses[-1] == 37 and len(guesses) <= 7
    answers = [m["content"] for m in demo if m["role"] == "tool"]
    assert answers[:2] == ["lower: between 1 and 49, middle 25", "higher: between 26 and 49, middle 37"]  # 50, 25


def test_guess_number_pays_each_turn_the_information_it_gained():
    """Hand-computed: reward = 0.5 * ln(interval before / interval after) / ln(100)."""
    env, task, ln100 = GuessNumberEnv(), {"question": "?", "secret": 70}, math.log(100)
    halved = env.step(task, 0, "", [guess(50)], ["higher"], {})  # [1, 100] -> [51, 100]
    assert halved.state == {"low": 51, "high": 100}
    assert halved.reward == pytest.approx(0.5 * math.log(2) / ln100)  # 0.0753
    outside = env.step(task, 1, "", [guess(30)], ["higher"], halved.state)  # already known: nothing gained
    assert outside.state == halved.state and outside.reward == 0.0
    malformed = env.step(task, 2, "", [{"name": "", "arguments": {}}], ["Error: not valid JSON"], halved.state)
    assert malformed.state == halved.state and malformed.reward == 0.0
    narrowed = env.step(task, 3, "", [guess(90)], ["lower"], halved.state)  # [51, 100] -> [51, 89]
    assert narrowed.reward == pytest.approx(0.5 * math.log(50 / 39) / ln100)  # 0.0270
    solved = env.step(task, 4, "", [guess(70)], ["correct"], narrowed.state)  # [51, 89] -> [70, 70]
    assert solved.done and solved.reward == pytest.approx(0.5 * math.log(39) / ln100)  # 0.3978
    # potential-based: every solved episode gains 0.5 in all, whatever the path
    assert halved.reward + outside.reward + narrowed.reward + solved.reward == pytest.approx(0.5)
    assert env.step(task, 0, "", [guess(70)], ["correct"], {}).reward == pytest.approx(0.5)


def test_the_environment_state_travels_with_the_rollout(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    config = RunConfig(task={"name": "guess-number", "rollouts": 8, "group_size": 4, "max_turns": 5})
    turns = run_episodes(engine, tokenizer, config)
    rows = {(row["rollout_id"], row["turn"]): row for row in turns}
    assert all(row["env_state"] == "{}" for (_, turn), row in rows.items() if turn == 0)
    followed = 0
    for (rollout_id, turn), row in rows.items():
        state = json.loads(row["next_env_state"])
        secret = json.loads(row["task_payload"])["secret"]
        assert state["low"] <= secret <= state["high"]  # the interval always holds the number
        if (rollout_id, turn + 1) in rows:
            assert rows[rollout_id, turn + 1]["env_state"] == row["next_env_state"]
            followed += 1
    assert followed > 0


def test_weather_needs_two_lookups_and_a_subtraction():
    env = WeatherEnv()
    task = env.sample_task(random.Random(1))
    first, second = task["cities"]
    (a, b) = run_tool_calls(
        [ToolCall("get_weather", {"location": first}), ToolCall("get_weather", {"location": second.upper()})],
        TOOLS,
        30,
        task=task,
    )
    assert (a.content, b.content) == (f"{task['weather'][first]} C", f"{task['weather'][second]} C")
    demo = env.demonstration(task)
    assert len(demo[2]["tool_calls"]) == 2  # two calls in one assistant turn
    assert env.reward(task, {"content": demo[-1]["content"]}) == 1.0
    assert env.reward(task, {"content": f"It is {task['answer'] + 1} degrees."}) == 0.0


def test_a_task_mix_splits_groups_by_weight_and_never_mixes_a_group():
    assert groups_per_task(parse_task_mix("calculator:3,guess-number:1"), 32 // 4) == [
        *["calculator"] * 6,
        *["guess-number"] * 2,
    ]
    with pytest.raises(ValueError, match="positive weight"):
        TaskConfig(name="calculator:0")
    config = RunConfig(task={"name": "calculator,weather", "rollouts": 16, "group_size": 4})
    starts = rollout_starts(config, iteration=0)
    by_group: dict[int, set[str]] = {}
    for start in starts:
        by_group.setdefault(start["group_id"], set()).add(start["task"])
    assert all(len(tasks) == 1 for tasks in by_group.values())
    assert sorted(t for (t,) in by_group.values()) == ["calculator", "calculator", "weather", "weather"]
    weather = next(s for s in starts if s["task"] == "weather")
    assert [t["function"]["name"] for t in weather["tools"]] == ["get_weather", "calculate"]


def rollout_starts(config: RunConfig, iteration: int) -> list[dict]:
    return starts_of(GenerateSettings.resolve(config), iteration)


class ShapedCalculator(CalculatorEnv):
    """Per-turn rewards, and stop strings for the turn after a tool call."""

    name = "shaped-calculator"

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state):
        step = super().step(task, turn, assistant_text, tool_calls, tool_results, state)
        step.reward = 0.25 if tool_calls else 0.0
        step.stop = ["returned"]
        return step


class BrokenEnv(CalculatorEnv):
    name = "broken"

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state):
        raise RuntimeError("environment bug")


@pytest.fixture
def custom_environments(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "shaped-calculator", ShapedCalculator())
    monkeypatch.setitem(ENVIRONMENTS, "broken", BrokenEnv())


@pytest.mark.usefixtures("custom_environments")
def test_per_turn_rewards_stop_strings_and_a_raising_environment(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    config = RunConfig(task={"name": "shaped-calculator,broken", "rollouts": 8, "group_size": 4, "max_turns": 3})
    turns = run_episodes(engine, tokenizer, config)
    shaped = [row for row in turns if row["task"] == "shaped-calculator"]
    called = [row for row in shaped if row["tool_calls"] and row["turn"] == 0]
    assert called and all(row["turn_reward"] == 0.25 for row in called)
    later = [row for row in shaped if row["turn"] == 1]
    assert later and all(row["finish_reason"] == "stop_string" for row in later)
    assert all(tokenizer.decode(row["completion_token_ids"]).endswith("returned") for row in later)
    # the turn cut at a stop string is closed by the environment: its observation starts with EOS
    cut = [row for row in later if row["observation_token_ids"]]
    assert all(row["observation_token_ids"][0] == tokenizer.eos_token_id for row in cut)
    broken = [row for row in turns if row["task"] == "broken" and row["finish_reason"] == "stop"]
    assert broken and all(row["failed"] and "environment bug" in row["failure"] for row in broken)
    assert all(math.isnan(row["reward"]) for row in broken)
    metrics = rollout_metrics(turns, Tasks.resolve(config).environments(), config.task.max_turns)
    assert metrics["per_task"]["broken"]["failed_rate"] == len(broken) / 4
    assert metrics["per_task"]["shaped-calculator"]["failed_rate"] == 0.0


def test_the_prompt_lists_the_environments_tools(tiny):
    _, tokenizer = tiny
    env = GuessNumberEnv()
    text = tokenizer.decode(
        prompt_token_ids(tokenizer, env.reset(env.sample_task(random.Random(0))), [tool_schema(TOOLS["guess"])], True)
    )
    assert '"name": "guess"' in text and '"task"' not in text and text.endswith("<|im_start|>assistant\n")


def test_a_plugin_registers_a_tool_and_an_environment(tiny):
    from stages.registry import load_plugins

    load_plugins(["plugin_countdown"])
    try:
        config = RunConfig(
            task={"name": "multiply", "rollouts": 2, "group_size": 2, "max_turns": 2, "plugins": ["plugin_countdown"]}
        )
        model, tokenizer = tiny
        turns = run_episodes(
            HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode),
            tokenizer,
            config,
        )
        assert set(turns["task"]) == {"multiply"}
        (result,) = run_tool_calls([ToolCall("multiply", {"a": 6, "b": 7})], TOOLS, 30)  # in a worker process
        assert result.content == "42"
        assert set(Tasks.resolve(config).code) == {"multiply"}
    finally:
        ENVIRONMENTS.pop("multiply", None)
        TOOLS.pop("multiply", None)


class NoToolsEnv(CalculatorEnv):
    name, tools = "no-tools", ()


def test_a_task_without_tools_is_answered_in_one_turn(monkeypatch):
    """A tool-less environment (a question to answer, a text game) shows the model no tools."""
    monkeypatch.setitem(ENVIRONMENTS, NoToolsEnv.name, NoToolsEnv())
    starts = rollout_starts(RunConfig(task={"name": NoToolsEnv.name, "rollouts": 2, "group_size": 2}), iteration=0)
    assert [start["tools"] for start in starts] == [[], []]


class UnknownToolEnv(CalculatorEnv):
    name, tools = "unknown-tool", ("teleport",)


def undocumented(x: int) -> str:
    return str(x)


class UndocumentedToolEnv(CalculatorEnv):
    name, tools = "undocumented-tool", ("undocumented",)


class FailingStartEnv(CalculatorEnv):
    name = "failing-start"

    def sample_task(self, rng):
        raise KeyError("dataset row")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (UnknownToolEnv(), "environment 'unknown-tool' uses unregistered tool(s) ['teleport']"),
        (FailingStartEnv(), "environment 'failing-start' failed to start a task: KeyError"),
        (UndocumentedToolEnv(), "tool 'undocumented' of environment 'undocumented-tool' has no usable JSON schema"),
    ],
)
def test_a_broken_environment_is_a_clear_error_before_any_rollout(monkeypatch, env, message):
    monkeypatch.setitem(ENVIRONMENTS, env.name, env)
    monkeypatch.setitem(TOOLS, "undocumented", undocumented)
    with pytest.raises(ValueError, match=re.escape(message)):
        rollout_starts(RunConfig(task={"name": env.name, "rollouts": 2, "group_size": 2}), iteration=0)


def closure_tool():
    def doubled(x: int) -> str:
        """Double a number.

        Args:
            x: The number.
        """
        return str(2 * x)

    return doubled


class ClosureToolEnv(CalculatorEnv):
    name, tools = "closure-tool", ("doubled",)


def test_a_tool_a_sandbox_worker_cannot_import_is_refused_at_run_start(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, ClosureToolEnv.name, ClosureToolEnv())
    monkeypatch.setitem(TOOLS, "doubled", closure_tool())
    task = {"name": ClosureToolEnv.name, "rollouts": 2, "group_size": 2}
    message = "tool 'doubled' of environment 'closure-tool' cannot run in a sandbox worker"
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        rollout_starts(RunConfig(task=task), iteration=0)
    assert "module-level function" in str(refused.value) and "tools.sandbox: false" in str(refused.value)
    assert len(rollout_starts(RunConfig(task=task, tools={"sandbox": False}), iteration=0)) == 2  # threads, chosen


def test_turns_to_solve_averages_solved_rollouts_and_censors_unsolved_ones_at_the_limit():
    # Four guess-number rollouts (limit 50): solved after 3 turns, solved after 7, gave up at
    # turn 2 (unsolved), and failed (infrastructure: counted in neither mean).
    #   mean_turns_to_solve = (3 + 7) / 2 = 5;  or_limit = (3 + 7 + 50) / 3 = 20
    def rows(rollout_id, turns, stop, reward, failed=False):
        return [
            {
                "rollout_id": rollout_id,
                "task": "guess-number",
                "turn": turn,
                "stop_reason": stop if turn == turns - 1 else None,
                "reward": reward,
                "failed": failed,
                "completion_token_ids": [1, 2],
                "observation_token_ids": [3],
            }
            for turn in range(turns)
        ]

    data = dataset_from_rows(
        rows(0, 3, "done", 0.94)
        + rows(1, 7, "done", 0.86)
        + rows(2, 2, "done", 0.0)
        + rows(3, 4, None, math.nan, True),
        ASSIGN_REWARDS,
    )
    metrics = rollout_metrics(data, ENVIRONMENTS, max_turns=None)  # guess-number's own limit, 50
    assert metrics["mean_turns_to_solve"] == 5.0
    assert metrics["mean_turns_to_solve_or_limit"] == 20.0
    assert metrics["success_rate"] == pytest.approx(2 / 3) and metrics["failed_rate"] == 0.25


def test_each_way_a_rollout_ends_gets_its_final_reward_on_every_row():
    # calculator (answer 5): a right answer, a wrong one, the turn limit, a turn that never
    # ended (length: the overlong reward), and a tool worker crash (failed: NaN, never 0).
    def rows(rollout_id, stops, content="", failed=False):
        return [
            {
                "rollout_id": rollout_id,
                "task": "calculator",
                "task_payload": json.dumps({"answer": 5}),
                "turn": turn,
                "content": content,
                "tool_calls": [],
                "stop_reason": stop,
                "failed": failed and stop is not None,
            }
            for turn, stop in enumerate(stops)
        ]

    data = dataset_from_rows(
        rows(0, [None, "done"], "The result is 5.")
        + rows(1, ["done"], "The result is 6.")
        + rows(2, [None, None, "max_turns"])
        + rows(3, [None, "length"])
        + rows(4, ["failed"], failed=True),
        EXECUTE_TOOLS,
    )
    settings = RewardSettings.resolve(RunConfig(reward={"truncated_reward": -0.25, "overlong_reward": -0.75}))
    scored = assign_rewards(data, ENVIRONMENTS, settings)
    expected = {0: 1.0, 1: 0.0, 2: -0.25, 3: -0.75}
    for rollout_id, reward in zip(scored["rollout_id"], scored["reward"]):
        if rollout_id == 4:
            assert math.isnan(reward)
        else:
            assert reward == expected[rollout_id]
    assert len(scored) == 9


def test_an_environment_whose_reward_raises_fails_its_rollout_not_the_stage():
    """Like an exception in step: the rollout is flagged with the message, never scored 0."""

    class RaisingReward(CalculatorEnv):
        name = "raising-reward"

        def reward(self, task, final_turn):
            raise KeyError("answer")

    rows = [
        {
            "rollout_id": r,
            "task": task,
            "task_payload": json.dumps({"answer": 5}),
            "turn": 0,
            "content": "5",
            "tool_calls": [],
            "stop_reason": "done",
            "failed": False,
        }
        for r, task in ((0, "calculator"), (1, "raising-reward"))
    ]
    scored = assign_rewards(
        dataset_from_rows(rows, EXECUTE_TOOLS),
        {**ENVIRONMENTS, "raising-reward": RaisingReward()},
        RewardSettings.resolve(RunConfig()),
    )
    assert scored["failed"] == [False, True] and scored["reward"][0] == 1.0 and math.isnan(scored["reward"][1])
    assert "environment 'raising-reward' reward raised KeyError('answer')" in scored["failure"][1]
    assert scored.column_names == list(ASSIGN_REWARDS)
