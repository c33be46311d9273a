"""Agent programs as they are: an OpenAI-compatible endpoint that records every token (docs/agents.md).

With `agent.function` set, generate-rollouts does not run the native turn loop: it serves the policy
on 127.0.0.1 (endpoint.py), runs the user's agent program once per rollout in a child process
(child.py), each rollout with its own base URL and key, and records every model call on its own
side (record.py): the context tokens the model saw, the sampled completion and its logprobs. The
record then becomes the usual rows, call k of a rollout its turn k:

    generate-rollouts turn k    the call: context (a delta, or a new segment's whole context), completion
    execute-tools turn k        what the agent added before its next call (tool results, user turns), as
                                tokens when the next call continues the same stream; how the rollout ended
    assign-rewards              the reward the agent returned, or its task's reward of the final answer

What the agent did after a call rides in that call's `env_state` (schemas.features.AGENT_STATE), so
execute-tools and assign-rewards stay functions of their stored inputs and re-run as any stage does.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from pydantic import computed_field

from runtime.hashing import module_closure, source_version
from schemas.stage import Settings, read


class AgentSettings(Settings):
    function: str | None = read("agent.function")  # MODULE:FUNCTION, or None: the native loop
    concurrency: int = read("agent.concurrency", placement=True)
    python: str | None = read("agent.python", placement=True)  # the agents' interpreter: where they run
    timeout_s: float = read("agent.timeout_s")  # a hung agent fails its rollout: it shapes the rows
    max_calls: int | None = read("agent.max_calls")
    # Where the agents run (docs/agents.md, Agents on other machines): not what they compute
    runner: str = read("agent.runner", placement=True)
    host: str = read("agent.host", placement=True)  # the address the endpoint binds
    ray_resources: dict[str, float] = read("agent.ray_resources", placement=True)
    ray_tasks: int = read("agent.ray_tasks", placement=True)
    ray_address: str | None = read("runner.ray_address", placement=True)

    @computed_field  # type: ignore[prop-decorator]
    @functools.cached_property
    def code(self) -> str | None:
        """What versions the agent program: its module, the modules of its own top-level package it
        imports, and, when its module sits in a package, every Python file under that package's folder
        (what it runs without importing: a script, a harness started as a process). Editing the agent
        gives new versions."""
        if self.function is None:
            return None
        source = Path(agent_source(self.function))
        top = self.function.partition(":")[0].split(".")[0]
        files = set(module_closure([source], Path.cwd(), (top,)))
        if (source.parent / "__init__.py").is_file():
            files |= set(source.parent.rglob("*.py"))
        return source_version(*sorted(files))


def agent_source(function: str) -> str:
    """The file that defines MODULE of MODULE:FUNCTION (the working directory searched first, as the
    agents' process searches it)."""
    module, _, name = function.partition(":")
    if not module or not name:
        raise ValueError(f"agent.function '{function}' must be MODULE:FUNCTION, e.g. examples.agents.openai_loop:agent")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    spec = _found(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"agent.function '{function}': no module '{module}' (searched the working directory first)")
    return spec.origin


def _found(module: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of a dotted module found on sys.path without running its packages' __init__ (they may
    import what only the agent's own environment has, agent.python); one whose path no plain folder
    holds (an installed package's own finder) is found by importing its packages."""
    parts = module.split(".")
    search, spec = None, None
    for depth in range(1, len(parts) + 1):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), search)
        if spec is None or (depth < len(parts) and spec.submodule_search_locations is None):
            try:
                return importlib.util.find_spec(module)
            except ModuleNotFoundError:  # a package of its path is missing
                return None
        search = spec.submodule_search_locations
    return spec
