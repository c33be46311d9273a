"""The iteration's tasks: user plugins, the task mix, turn limits, the first messages of each
rollout (which generate-rollouts renders at turn 0) and the code versions of the environments
and tools in use."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys
from typing import Any

from runtime.hashing import source_version
from schemas.config import RunConfig
from schemas.token_stream import prompt_token_ids
from stages.environments import ENVIRONMENTS
from stages.tools import NOT_SANDBOXABLE, TOOLS, importable_by_name, tool_schema


def load_plugins(modules: list[str]) -> None:
    """Import user modules that register tools (TOOLS) and environments (ENVIRONMENTS); the
    working directory is searched first, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        importlib.import_module(module)


def environment_code(config: RunConfig) -> dict[str, str]:
    """Code version of each environment of the task mix and of its tools: a hash of the source
    files that define them, so editing a reward function or a tool gives new versions."""
    return environments_code([name for name, _ in config.task.mix()])


def environments_code(names: list[str]) -> dict[str, str]:
    """environment_code of these environments (e.g. the warm start's mix, sft.task)."""
    versions = {}
    for name in names:
        environment = ENVIRONMENTS[name]
        files = {inspect.getsourcefile(type(environment))}
        files |= {inspect.getsourcefile(TOOLS[tool]) for tool in environment.tools}
        versions[name] = source_version(*sorted(files))
    return versions


def tool_schemas(environment: Any) -> list[dict[str, Any]]:
    """The JSON schemas of an environment's tools, as its prompts show them to the model."""
    return [tool_schema(TOOLS[tool]) for tool in environment.tools]


def task_turn_limits(config: RunConfig) -> dict[str, int]:
    """Each task's turn limit: task.max_turns, or its environment's own."""
    return {name: ENVIRONMENTS[name].turn_limit(config.task.max_turns) for name, _ in config.task.mix()}


def turn_limit(config: RunConfig) -> int:
    """Rounds of an iteration at most: the longest turn limit of the mix (each rollout is
    still cut at its own task's limit)."""
    return max(task_turn_limits(config).values())


def check_environments(config: RunConfig) -> None:
    """Every task of the mix is registered, has tools, and its tools are registered, have a JSON
    schema (a typed signature and a docstring with an Args section) and, with tools.sandbox,
    can be imported by a sandbox worker: checked before any work."""
    for name, _ in config.task.mix():
        if name not in ENVIRONMENTS:
            raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(ENVIRONMENTS))}")
        environment = ENVIRONMENTS[name]
        if not environment.tools:
            raise ValueError(f"environment '{name}' lists no tools; a tool-using task needs at least one")
        missing = [tool for tool in environment.tools if tool not in TOOLS]
        if missing:
            raise ValueError(
                f"environment '{name}' uses unregistered tool(s) {missing}; registered: {', '.join(TOOLS)}"
            )
        for tool in environment.tools:
            try:
                tool_schema(TOOLS[tool])
            except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
                raise ValueError(
                    f"tool '{tool}' of environment '{name}' has no usable JSON schema: {exc} "
                    "(it needs type hints and a Google-style docstring with an Args section)"
                ) from None
            if config.tools.sandbox and not importable_by_name(TOOLS[tool]):
                raise ValueError(f"tool '{tool}' of environment '{name}' {NOT_SANDBOXABLE}")


def check_tools_reach_the_model(tokenizer: Any, config: RunConfig, model: str) -> None:
    """Every task's tools are in the prompt the model sees. A chat template without a tools
    section (SmolLM2's, for one) renders the same tokens with and without them: the model would
    never be told its tools exist, and RL would train on regardless."""
    for name, _ in config.task.mix():
        environment = ENVIRONMENTS[name]
        messages = environment.reset(environment.sample_task(random.Random(0)))
        tools = tool_schemas(environment)
        thinking = config.generation.enable_thinking
        prompt = prompt_token_ids(tokenizer, messages, tools, thinking)
        if prompt == prompt_token_ids(tokenizer, messages, None, thinking):
            raise ValueError(
                f"{model}: its chat template renders the same {len(prompt)} tokens with and without the tools of "
                f"task '{name}' ({', '.join(environment.tools)}), so the model would never be told they exist. Set "
                "model.chat_template to a template that renders tools: hermes (the Hermes tool-calling template mtrl "
                "ships, for ChatML models such as SmolLM2 and Qwen) or a Jinja file"
            )


def rollout_starts(config: RunConfig, iteration: int) -> list[dict[str, Any]]:
    """The iteration's tasks: rollouts / group_size groups, each one task of one environment
    (split by the task mix) sampled group_size times. A group never mixes tasks."""
    check_environments(config)
    rng = random.Random(f"tasks/{config.seed}/{iteration}")
    starts = []
    for group_id, name in enumerate(config.task.groups_per_task()):
        environment = ENVIRONMENTS[name]
        tools = tool_schemas(environment)
        try:
            task = environment.sample_task(rng)
            messages = environment.reset(task)
            json.dumps(task)
        except Exception as exc:
            raise ValueError(f"environment '{name}' failed to start a task: {exc.__class__.__name__}: {exc}") from exc
        for _ in range(config.task.group_size):
            starts.append(
                {
                    "rollout_id": len(starts),
                    "group_id": group_id,
                    "task": environment.name,
                    "task_id": f"{environment.name}-{iteration}-{group_id}",
                    "task_payload": json.dumps(task, sort_keys=True),
                    "messages": messages,
                    "tools": tools,
                }
            )
    return starts
