"""What a task name and a tool name mean in a run (`Tasks`, the settings every stage that meets tasks
shares), what versions them, and the checks of a run's tasks.

A task name is a registered environment (ENVIRONMENTS: the built-in tasks and plugins') or an
ecosystem adapter PREFIX/NAME (stages/ecosystem: reasoning-gym, textarena, OpenEnv) made with the
task's settings (task.options); task.tools may replace the tools a task offers. A tool name is a
registered Python function (TOOLS) or a tool of an MCP server in tools.mcp_servers. Every stage
that meets tasks or tools resolves them here, from its `Tasks`, the same way.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import computed_field

from runtime.hashing import source_version
from schemas.stage import Settings, read
from schemas.task_mix import TaskMix
from schemas.token_stream import prompt_token_ids
from stages.ecosystem import ADAPTERS, adapted_environment, import_adapter, is_adapted
from stages.environments import ENVIRONMENTS, Environment
from stages.tools import NOT_SANDBOXABLE, TOOLS, RemoteTool, importable_by_name, tool_schema


def load_plugins(modules: list[str]) -> None:
    """Import user modules that register tools (TOOLS) and environments (ENVIRONMENTS); the
    working directory is searched first, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        importlib.import_module(module)


class Tasks(Settings):
    """The tasks of a run as the stages meet them: the mix of environments and how each is set up."""

    mix: TaskMix = read("task.name")  # (environment, weight) of 'calculator' or 'calculator:3,weather:1'
    max_turns: int | None = read("task.max_turns")
    options: dict[str, dict[str, Any]] = read("task.options")
    offered_tools: dict[str, list[str]] = read("task.tools")
    plugins: list[str] = read("task.plugins")
    # how to reach the MCP servers (a command or a URL, a start timeout): what their tools do is hashed
    # as the tools' identity in `code` (the server's name and version, the tool's schema, the client)
    mcp_servers: list[dict[str, Any]] = read("tools.mcp_servers", placement=True)

    def names(self) -> list[str]:
        return [name for name, _ in self.mix]

    def environment(self, name: str) -> Environment:
        """The environment of a task name: a registered one (the built-in tasks and plugins'), or an
        ecosystem adapter PREFIX/NAME (stages/ecosystem) made with its options; offered_tools[name],
        when set, replaces the tools it offers."""
        load_plugins(self.plugins)
        options = self.options.get(name, {})
        if name in ENVIRONMENTS:
            if options:
                raise ValueError(f"task.options['{name}']: the environment '{name}' takes no options")
            found = ENVIRONMENTS[name]
        elif is_adapted(name):
            found = adapted_environment(name, json.dumps(options, sort_keys=True))
        else:
            adapters = ", ".join(f"{prefix}/NAME" for prefix in ADAPTERS)
            raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(ENVIRONMENTS))}, or {adapters}")
        offered = self.offered_tools.get(name)
        if offered is None or tuple(offered) == tuple(found.tools):
            return found
        replaced = copy.copy(found)  # the registered environment stays as it is
        replaced.tools = tuple(offered)
        return replaced

    def environments(self) -> dict[str, Environment]:
        """The environment of every task of the mix, by task name."""
        return {name: self.environment(name) for name in self.names()}

    def tools(self) -> dict[str, Any]:
        """The tools tasks may name: the registered Python functions (TOOLS) and the tools of the MCP
        servers (started or reached once per process)."""
        load_plugins(self.plugins)
        if not self.mcp_servers:
            return TOOLS
        served = import_adapter("mcp", "mcp").served_tools(json.dumps(self.mcp_servers, sort_keys=True))
        clashes = sorted(set(served) & set(TOOLS))
        if clashes:
            raise ValueError(f"tools.mcp_servers: tool(s) {clashes} have the name of a registered tool")
        return {**TOOLS, **served}

    def turn_limit(self, name: str) -> int:
        """A task's turn limit: max_turns, or its environment's own."""
        return self.environment(name).turn_limit(self.max_turns)

    def longest_turn_limit(self) -> int:
        """Rounds of an iteration at most: the longest turn limit of the mix (each rollout is still
        cut at its own task's limit)."""
        return max(self.turn_limit(name) for name in self.names())

    @computed_field  # type: ignore[prop-decorator]
    @functools.cached_property
    def code(self) -> dict[str, Any]:
        """What versions each environment of the mix and its tools: a hash of the source files that
        define them (editing a reward function or a tool gives new versions), and for an adapter
        or a remote tool what else shapes its behaviour (a package's version, settings, a server
        and its tool schemas)."""
        tools = self.tools()
        versions = {}
        for name in self.names():
            found = self.environment(name)
            own = [] if found.runs_tool_calls else [tools[tool] for tool in found.tools]
            files = {inspect.getsourcefile(type(found))}
            files |= {inspect.getsourcefile(tool) for tool in own if not isinstance(tool, RemoteTool)}
            remote = {tool.schema["function"]["name"]: tool.identity for tool in own if isinstance(tool, RemoteTool)}
            versions[name] = {"code": source_version(*sorted(files)), **({"tools": remote} if remote else {})}
            versions[name].update(found.identity())
        return versions


def tool_schemas(environment: Environment, tools: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON schemas of an environment's tools, as its prompts show them to the model."""
    if environment.runs_tool_calls:
        return environment.own_tool_schemas
    return [tool_schema(tools[tool]) for tool in environment.tools]


def check_run_tasks(
    mixes: list[Tasks], sandbox: bool, settings_by_task: dict[str, list[str]], named_elsewhere: Sequence[str] = ()
) -> None:
    """The task mixes of a run (RL's, and the warm start's) before any work: check_tasks of each, and
    every task named by a per-task setting (`settings_by_task`: task.options, task.tools -> the task
    names they hold) is one the run uses or one of `named_elsewhere` (tasks the config names that
    this command does not run)."""
    names = [name for tasks in mixes for name in tasks.names()] + list(named_elsewhere)
    for setting, named in settings_by_task.items():
        strangers = sorted(set(named) - set(names))
        if strangers:
            raise ValueError(f"{setting} names {strangers}, which the run does not use (tasks: {names})")
    for tasks in mixes:
        check_tasks(tasks, sandbox)


def start_task(environment: Environment, name: str, rng: random.Random) -> tuple[Any, list[dict[str, Any]]]:
    """A task of the environment (task `name`) sampled with `rng`, and its first messages; both
    JSON, as the rollouts store them. Any failure (a game that needs a download, a bad generator
    option, an environment server that is down) is a ValueError naming the task."""
    try:
        task = environment.sample_task(rng)
        messages = environment.reset(task)
        json.dumps([task, messages])
    except Exception as exc:
        raise ValueError(f"environment '{name}' failed to start a task: {exc.__class__.__name__}: {exc}") from exc
    return task, messages


def check_tasks(tasks: Tasks, sandbox: bool) -> None:
    """Every task of the mix is registered or adapted and starts a task; its tools are registered,
    have a JSON schema (a typed signature and a docstring with an Args section) and, in the sandbox,
    can be imported by a worker process: checked before any work."""
    tools = tasks.tools()
    for name in tasks.names():
        found = tasks.environment(name)
        start_task(found, name, random.Random(0))
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
            if sandbox and not remote and not importable_by_name(tools[tool]):
                raise ValueError(f"tool '{tool}' of environment '{name}' {NOT_SANDBOXABLE}")


def check_tools_reach_the_model(tokenizer: Any, mixes: list[Tasks], enable_thinking: bool, model: str) -> None:
    """Every task's tools (of every task mix of the run: RL's, the warm start's) are in the prompt the
    model sees. A chat template without a tools section (SmolLM2's, for one) renders the same tokens
    with and without them: the model would never be told its tools exist, and RL would train on
    regardless."""
    found = [(tasks.environment(name), name, tasks.tools()) for tasks in mixes for name in tasks.names()]
    for environment, name, tools in found:
        schemas = tool_schemas(environment, tools)
        if not schemas:
            continue  # a task without tools (a text game) has none to show
        messages = start_task(environment, name, random.Random(0))[1]
        prompt = prompt_token_ids(tokenizer, messages, schemas, enable_thinking)
        if prompt == prompt_token_ids(tokenizer, messages, None, enable_thinking):
            raise ValueError(
                f"{model}: its chat template renders the same {len(prompt)} tokens with and without the tools of "
                f"task '{name}' ({', '.join(environment.tools)}), so the model would never be told they exist. Set "
                "model.chat_template to a template that renders tools: hermes (the Hermes tool-calling template mtrl "
                "ships, for ChatML models such as SmolLM2 and Qwen) or a Jinja file"
            )
