"""Environments and tools that others wrote, run as they are (docs/environments.md).

A task named PREFIX/NAME is an adapter of an ecosystem package onto mtrl's Environment
contract (stages/environments.py), built with the task's settings (task.options[task name]):

    reasoning-gym/NAME   a reasoning-gym generator, graded by its own scorer   (reasoning_gym.py)
    textarena/ENV_ID     a single-player textarena game                        (textarena.py)
    openenv/LABEL        an OpenEnv environment, in process or at a URL        (openenv.py)

and tools.mcp_servers names MCP tool servers whose tools become tools (mcp.py).

Each adapter module is imported only when a task needs it, by name: the packages are an optional
extra (`pip install 'mtrl[ecosystem]'`), `mtrl ls` stays light, and a stage's version hashes an
adapter's code only where a task uses it (through the task's environment code version,
stages/registry.py: Tasks.code), never in a run of mtrl's own tasks.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

ADAPTERS = {  # task prefix -> (module of stages.ecosystem, class, the distribution it adapts)
    "reasoning-gym": ("reasoning_gym", "ReasoningGymEnv", "reasoning-gym"),
    "textarena": ("textarena", "TextArenaEnv", "textarena"),
    "openenv": ("openenv", "OpenEnvEnv", "openenv-core"),
}
EXTRA = "pip install 'mtrl[ecosystem]' (make setup installs it)"


def is_adapted(name: str) -> bool:
    """Is this task name PREFIX/NAME of an adapter?"""
    prefix, slash, rest = name.partition("/")
    return bool(slash and rest) and prefix in ADAPTERS


def import_adapter(module: str, distribution: str) -> Any:
    """A module of stages.ecosystem, or a ValueError naming the missing package."""
    try:
        return importlib.import_module(f"stages.ecosystem.{module}")
    except ImportError as exc:
        raise ValueError(f"{distribution} is not installed ({exc}): {EXTRA}") from None


@functools.lru_cache(maxsize=256)
def adapted_environment(name: str, options_json: str) -> Any:
    """The adapter of task PREFIX/NAME with these settings (JSON), made once per process."""
    prefix, _, inner = name.partition("/")
    module, cls, distribution = ADAPTERS[prefix]
    adapter = getattr(import_adapter(module, distribution), cls)
    try:
        return adapter(inner, json.loads(options_json))
    except ValueError:
        raise
    except Exception as exc:  # an environment server that is down, a class that fails to start
        raise ValueError(f"task '{name}' cannot be set up: {exc.__class__.__name__}: {exc}") from exc
