"""reasoning-gym generators as tasks (stages/ecosystem/reasoning_gym.py), with the real package:
the reward is the package's own scorer, the prompt says how to answer, demonstrations warm-start,
evaluation tasks come from other seeds, and the package and the settings version the stages."""

from __future__ import annotations

import json
import random

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from pipeline.store.versions import Store
from schemas.config import RunConfig
from stages.generate_rollouts import GenerateSettings
from stages.generate_rollouts import rollout_starts as starts_of
from stages.registry import Tasks, check_run_tasks
from stages.sft import DemonstrationTasks, check_demonstrations, demonstration_sequence, demonstrators

# Cheap generators whose scorer gives an answer without the gold one in it no partial credit (some do).
GENERATORS = (
    "chain_sum",
    "products",
    "gcd",
    "lcm",
    "leg_counting",
    "letter_counting",
    "spell_backward",
    "base_conversion",
    "simple_equations",
    "calendar_arithmetic",
    "tower_of_hanoi",
    "number_sorting",
)


def task_name(generator: str) -> str:
    return f"reasoning-gym/{generator}"


def environment(config: RunConfig, name: str):
    return Tasks.resolve(config).environment(name)


def check_environments(config: RunConfig) -> None:
    """The task checks of a run's pre-flight (pipeline/orchestration/preflight.py)."""
    per_task = {"task.options": list(config.task.options), "task.tools": list(config.task.tools)}
    check_run_tasks([Tasks.resolve(config)], config.tools.sandbox, per_task)


def rollout_starts(config: RunConfig, iteration: int) -> list[dict]:
    return starts_of(GenerateSettings.resolve(config), iteration)


def package_score(task: dict, generator: str, options: dict, content: str) -> float:
    """The package's scorer on an answer, its item made from the stored seed without mtrl."""
    dataset = reasoning_gym.create_dataset(generator, size=1, seed=task["seed"], **options)
    return float(dataset.score_answer(extract_answer(content), dataset[0]))


@pytest.mark.parametrize("generator", GENERATORS)
def test_the_reward_is_the_packages_scorer_gold_one_and_wrong_zero(generator):
    name = task_name(generator)
    env = environment(RunConfig(task={"name": name}), name)
    for task in (env.sample_task(random.Random(seed)) for seed in range(3)):
        (_, question) = env.reset(task)
        assert question["content"].startswith(task["question"].rstrip()) and "<answer>" in question["content"]
        gold = f"I think so.\n<answer>{task['answer']}</answer>"
        assert env.reward(task, {"content": gold}) == 1.0 == package_score(task, generator, {}, gold)
        for wrong in ("<answer>zzzz</answer>", "zzzz without the tags"):
            assert env.reward(task, {"content": wrong}) == 0.0 == package_score(task, generator, {}, wrong)
        assert env.solved(1.0) and not env.solved(0.5)  # partial credit is not a success


def test_generator_settings_reach_the_items_and_a_bad_one_is_refused():
    name = task_name("chain_sum")
    config = RunConfig(task={"name": name, "options": {name: {"min_terms": 4, "max_terms": 4, "max_digits": 1}}})
    task = environment(config, name).sample_task(random.Random(0))
    assert task["question"].count("+") + task["question"].count("-") == 3  # four terms
    bad = RunConfig(task={"name": name, "options": {name: {"min_terms": 4, "no_such_option": 1}}})
    with pytest.raises(ValueError, match="reasoning-gym/chain_sum: its options .* do not make items"):
        check_environments(bad)
    with pytest.raises(ValueError, match="unknown reasoning-gym generator 'no_such'"):
        check_environments(RunConfig(task={"name": "reasoning-gym/no_such"}))
    with pytest.raises(ValueError, match=r"task.options names \['reasoning-gym/gcd'\], which the run does not use"):
        check_environments(RunConfig(task={"name": name, "options": {"reasoning-gym/gcd": {}}}))


def test_the_package_version_and_the_settings_version_the_stages_they_shape():
    name = task_name("chain_sum")
    plain = Tasks.resolve(RunConfig(task={"name": name})).code[name]
    assert plain["package"] == "reasoning-gym==0.1.25" and plain["options"] == {}
    shorter = RunConfig(task={"name": name, "options": {name: {"max_terms": 3}}})
    assert Tasks.resolve(shorter).code[name]["options"] == {"max_terms": 3}
    calculator_only = RunConfig(task={"name": name, "tools": {name: ["calculate"]}})
    assert Tasks.resolve(calculator_only).code[name]["code"] != plain["code"]  # the python tool's file left out
    assert [tool["function"]["name"] for tool in rollout_starts(calculator_only, 0)[0]["tools"]] == ["calculate"]


def test_evaluation_tasks_come_from_other_seeds_than_training():
    from pipeline.cli.main import EVAL_ITERATION

    config = RunConfig(task={"name": task_name("gcd"), "rollouts": 64, "group_size": 1})
    seeds = {json.loads(start["task_payload"])["seed"] for it in range(5) for start in rollout_starts(config, it)}
    evaluation = {json.loads(start["task_payload"])["seed"] for start in rollout_starts(config, EVAL_ITERATION)}
    assert len(seeds) == 5 * 64 and len(evaluation) == 64 and not seeds & evaluation


def test_demonstrations_answer_with_the_gold_answer_and_warm_start(tiny):
    _, tokenizer = tiny
    config = RunConfig(task={"name": "calculator"}, sft={"steps": 1, "task": "reasoning-gym/gcd,reasoning-gym/lcm"})
    tasks = demonstrators(DemonstrationTasks.resolve(config))
    check_demonstrations(tasks)
    env, schemas, _ = tasks[0]
    task = env.sample_task(random.Random(0))
    messages = env.demonstration(task)
    assert messages[-1] == {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}
    assert env.reward(task, messages[-1]) == 1.0
    sequence = demonstration_sequence(tokenizer, messages, schemas, enable_thinking=True)
    trained = tokenizer.decode([sequence.token_ids[i] for i in sequence.target_positions])
    assert trained.endswith(f"<answer>{task['answer']}</answer><|im_end|>")
    # where the task offers the calculator and the item's expression computes the gold answer, the
    # demonstration calls it first: the warm start shows the tool in use
    products = task_name("products")
    config = RunConfig(task={"name": products, "tools": {products: ["calculate"]}})
    env = environment(config, products)
    task = env.sample_task(random.Random(0))
    call, result, answer = env.demonstration(task)[2:]
    expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
    assert expression in task["question"] and result == {"role": "tool", "content": task["answer"]}
    assert answer == {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}
    # a generator without gold answers (only its scorer grades) cannot demonstrate
    no_gold = RunConfig(task={"name": "calculator"}, sft={"steps": 1, "task": "reasoning-gym/propositional_logic"})
    with pytest.raises(ValueError, match="has no gold answers"):
        check_demonstrations(demonstrators(DemonstrationTasks.resolve(no_gold)))


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_one_iteration_on_twelve_generators_scores_every_answer_with_the_package(tmp_path):
    from pipeline.orchestration.flows import rl_training

    names = ",".join(task_name(generator) for generator in GENERATORS)
    config = RunConfig(
        iterations=1,
        task={"name": names, "rollouts": 2 * len(GENERATORS), "group_size": 2, "max_turns": 2},
        generation={"max_new_tokens": 48},
        ppo={"minibatch_rollouts": 8},
        store={"runs_dir": tmp_path / "runs"},
    )
    (result,) = rl_training(config)
    store = Store(config.store.runs_dir)
    rewarded = store.load("assign-rewards", result["versions"]["assign-rewards"])
    finals = {}
    for row in rewarded:  # rows come rollout by rollout, in turn order: the last one wins
        finals[row["rollout_id"]] = row
    assert {row["task"] for row in finals.values()} == {task_name(g) for g in GENERATORS}
    scored = 0
    for row in finals.values():
        if row["stop_reason"] == "done" and not row["failed"]:
            task = json.loads(row["task_payload"])
            generator = row["task"].removeprefix("reasoning-gym/")
            assert row["reward"] == package_score(task, generator, {}, row["content"]), row["content"]
            scored += 1
    assert scored > 0
    manifest = store.manifest("assign-rewards", result["versions"]["assign-rewards"])
    assert manifest.settings["tasks"]["code"][task_name("gcd")]["package"] == "reasoning-gym==0.1.25"
    metrics = manifest.metrics["per_task"]
    assert set(metrics) == {task_name(g) for g in GENERATORS}
    # every task the run used resolves the same way in a fresh lookup (what a re-run of a stage does)
    assert set(Tasks.resolve(config).environments()) == {task_name(g) for g in GENERATORS}
