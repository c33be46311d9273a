"""What a task name and a tool name mean in a run, and what versions them.

A task name is a registered environment (ENVIRONMENTS: the built-in tasks and plugins') or an
ecosystem adapter PREFIX/NAME (stages/ecosystem: reasoning-gym, textarena, OpenEnv) made with the
task's settings (task.options); task.tools may replace the tools a task offers. A tool name is a
registered Python function (TOOLS) or a tool of an MCP server in tools.mcp_servers. Every stage
that meets tasks or tools resolves them here, from the run config, the same way.
"""

from __future__ import annotations

import copy
import inspect
import json
from typing import Any

from runtime.hashing import source_version
from schemas.config import RunConfig
from stages.ecosystem import ADAPTERS, adapted_environment, import_adapter, is_adapted
from stages.environments import ENVIRONMENTS, Environment
from stages.tools import TOOLS, RemoteTool, tool_schema


def environment(config: RunConfig, name: str) -> Environment:
    """The environment of a task name as the config sets it up: a registered one (ENVIRONMENTS: the
    built-in tasks and plugins'), or an ecosystem adapter PREFIX/NAME (stages/ecosystem) made with
    task.options[name]; task.tools[name], when set, replaces the tools it offers."""
    options = config.task.options.get(name, {})
    if name in ENVIRONMENTS:
        if options:
            raise ValueError(f"task.options['{name}']: the environment '{name}' takes no options")
        found = ENVIRONMENTS[name]
    elif is_adapted(name):
        found = adapted_environment(name, json.dumps(options, sort_keys=True))
    else:
        adapters = ", ".join(f"{prefix}/NAME" for prefix in ADAPTERS)
        raise ValueError(f"unknown task '{name}'; valid: {', '.join(sorted(ENVIRONMENTS))}, or {adapters}")
    offered = config.task.tools.get(name)
    if offered is None or tuple(offered) == tuple(found.tools):
        return found
    replaced = copy.copy(found)  # the registered environment stays as it is
    replaced.tools = tuple(offered)
    return replaced


def task_names(config: RunConfig) -> list[str]:
    """The tasks a run uses: its task mix, then its warm start's (sft.task) when that differs."""
    names = [name for name, _ in config.task.mix()]
    return names + [name for name, _ in config.sft_task_mix() if name not in names]


def run_environments(config: RunConfig) -> dict[str, Environment]:
    """The environment of every task the run uses, by task name."""
    return {name: environment(config, name) for name in task_names(config)}


def registered_tools(config: RunConfig) -> dict[str, Any]:
    """The tools tasks may name: the registered Python functions (TOOLS) and the tools of the MCP
    servers in tools.mcp_servers (started or reached once per process)."""
    if not config.tools.mcp_servers:
        return TOOLS
    servers = json.dumps([server.model_dump(mode="json") for server in config.tools.mcp_servers], sort_keys=True)
    served = import_adapter("mcp", "mcp").served_tools(servers)
    clashes = sorted(set(served) & set(TOOLS))
    if clashes:
        raise ValueError(f"tools.mcp_servers: tool(s) {clashes} have the name of a registered tool")
    return {**TOOLS, **served}


def environment_code(config: RunConfig) -> dict[str, Any]:
    """What versions each environment of the task mix and its tools: a hash of the source files
    that define them (editing a reward function or a tool gives new versions), and for an
    adapter or a remote tool what else shapes its behaviour (a package's version, settings, a
    server and its tool schemas)."""
    return environments_code(config, [name for name, _ in config.task.mix()])


def environments_code(config: RunConfig, names: list[str]) -> dict[str, Any]:
    """environment_code of these tasks (e.g. the warm start's mix, sft.task)."""
    tools = registered_tools(config)
    versions = {}
    for name in names:
        found = environment(config, name)
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
