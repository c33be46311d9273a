"""The run's task mix: user plugins, the checks of the tasks a run uses, turn limits and the
first messages of each rollout (which generate-rollouts renders at turn 0). What a task name and a
tool name mean is stages/registry.py."""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
from typing import Any

from schemas.config import RunConfig
from schemas.token_stream import prompt_token_ids
from stages.registry import environment, registered_tools, task_names, tool_schemas
from stages.tools import NOT_SANDBOXABLE, RemoteTool, importable_by_name, tool_schema


def load_plugins(modules: list[str]) -> None:
    """Import user modules that register tools (TOOLS) and environments (ENVIRONMENTS); the
    working directory is searched first, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        importlib.import_module(module)


def task_turn_limits(config: RunConfig) -> dict[str, int]:
    """Each task's turn limit: task.max_turns, or its environment's own."""
    return {name: environment(config, name).turn_limit(config.task.max_turns) for name, _ in config.task.mix()}


def turn_limit(config: RunConfig) -> int:
    """Rounds of an iteration at most: the longest turn limit of the mix (each rollout is
    still cut at its own task's limit)."""
    return max(task_turn_limits(config).values())


def check_environments(config: RunConfig) -> None:
    """Every task the run uses is registered or adapted and starts a task; its tools are
    registered, have a JSON schema (a typed signature and a docstring with an Args section) and,
    with tools.sandbox, can be imported by a sandbox worker; task.options and task.tools name
    tasks of the run: checked before any work."""
    names = task_names(config)
    for setting in ("options", "tools"):
        strangers = sorted(set(getattr(config.task, setting)) - set(names))
        if strangers:
            raise ValueError(f"task.{setting} names {strangers}, which the run does not use (tasks: {names})")
    tools = registered_tools(config)
    for name in names:
        found = environment(config, name)
        try:  # a game that needs a download, a bad generator option, an environment server that is down
            json.dumps(found.reset(found.sample_task(random.Random(0))))
        except Exception as exc:
            raise ValueError(f"environment '{name}' failed to start a task: {exc.__class__.__name__}: {exc}") from None
        if found.runs_tool_calls:
            continue  # its tools run inside its episodes (an OpenEnv MCPEnvironment's)
        missing = [tool for tool in found.tools if tool not in tools]
        if missing:
            raise ValueError(
                f"environment '{name}' uses unregistered tool(s) {missing}; registered: {', '.join(tools)}"
            )
        for tool in found.tools:
            try:
                tool_schema(tools[tool])
            except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
                raise ValueError(
                    f"tool '{tool}' of environment '{name}' has no usable JSON schema: {exc} "
                    "(it needs type hints and a Google-style docstring with an Args section)"
                ) from None
            remote = isinstance(tools[tool], RemoteTool)
            if config.tools.sandbox and not remote and not importable_by_name(tools[tool]):
                raise ValueError(f"tool '{tool}' of environment '{name}' {NOT_SANDBOXABLE}")


def check_tools_reach_the_model(tokenizer: Any, config: RunConfig, model: str) -> None:
    """Every task's tools are in the prompt the model sees. A chat template without a tools
    section (SmolLM2's, for one) renders the same tokens with and without them: the model would
    never be told its tools exist, and RL would train on regardless."""
    tools = registered_tools(config)
    for name in task_names(config):
        found = environment(config, name)
        schemas = tool_schemas(found, tools)
        if not schemas:
            continue  # a task without tools (a text game) has none to show
        messages = found.reset(found.sample_task(random.Random(0)))
        thinking = config.generation.enable_thinking
        prompt = prompt_token_ids(tokenizer, messages, schemas, thinking)
        if prompt == prompt_token_ids(tokenizer, messages, None, thinking):
            raise ValueError(
                f"{model}: its chat template renders the same {len(prompt)} tokens with and without the tools of "
                f"task '{name}' ({', '.join(found.tools)}), so the model would never be told they exist. Set "
                "model.chat_template to a template that renders tools: hermes (the Hermes tool-calling template mtrl "
                "ships, for ChatML models such as SmolLM2 and Qwen) or a Jinja file"
            )


def rollout_starts(config: RunConfig, iteration: int) -> list[dict[str, Any]]:
    """The iteration's tasks: rollouts / group_size groups, each one task of one environment
    (split by the task mix) sampled group_size times. A group never mixes tasks."""
    check_environments(config)
    rng = random.Random(f"tasks/{config.seed}/{iteration}")
    tools = registered_tools(config)
    starts = []
    for group_id, name in enumerate(config.task.groups_per_task()):
        found = environment(config, name)
        schemas = tool_schemas(found, tools)
        try:
            task = found.sample_task(rng)
            messages = found.reset(task)
            json.dumps(task)
        except Exception as exc:
            raise ValueError(f"environment '{name}' failed to start a task: {exc.__class__.__name__}: {exc}") from exc
        for _ in range(config.task.group_size):
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
