"""The pre-flight checks: what a run's config names must exist before any work starts. Every
flow runs them first (pipeline/orchestration/flows.py: a deployment's run starts there), and `mtrl` runs them
before it starts a Prefect server, to answer a bad command line in one line.
"""

from __future__ import annotations

import importlib.util

from schemas.config import RunConfig


class ConfigError(ValueError):
    """A config that names something this machine does not have."""


def check_config(config: RunConfig) -> None:
    """What the config's own validation cannot know (registries, installed extras, the model),
    checked before any work is done: a ConfigError says what is wrong."""
    from pipeline.models.base_model import check_starting_model
    from runtime.ray import RayError, check_ray_address
    from stages.compute_advantages import ESTIMATORS
    from stages.generate_rollouts.engine import ENGINES
    from stages.registry import Tasks, check_run_tasks, load_plugins
    from stages.sft import DemonstrationTasks, check_demonstrations, demonstrators

    try:
        load_plugins(config.task.plugins)
    except ImportError as exc:
        raise ConfigError(f"task.plugins: cannot import {exc.name!r}: {exc}") from None
    try:
        demonstrations = DemonstrationTasks.resolve(config)
        warm_start = [demonstrations] if config.sft.steps > 0 else []
        # sft.task's tasks may be set up by task.options and task.tools where no warm start trains
        # (`mtrl eval`, sft.steps=0): the flags of the run that made a warm start work unchanged
        named_elsewhere = demonstrations.names() if config.sft.task is not None else []
        per_task = {"task.options": list(config.task.options), "task.tools": list(config.task.tools)}
        check_run_tasks([Tasks.resolve(config), *warm_start], config.tools.sandbox, per_task, named_elsewhere)
        for tasks in warm_start:
            check_demonstrations(demonstrators(tasks))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.generation.engine not in ENGINES:
        raise ConfigError(
            f"unknown generation engine '{config.generation.engine}'; valid: {', '.join(sorted(ENGINES))}"
        )
    if config.generation.engine == "vllm":  # its environment (or server) is there, before a Prefect server starts
        from runtime.vllm_server import EngineError, vllm_version

        try:
            vllm_version(config.vllm.python, config.vllm.url)
        except (EngineError, OSError) as exc:
            raise ConfigError(f"generation.engine vllm: {exc}") from None
    if config.advantage.estimator not in ESTIMATORS:
        raise ConfigError(
            f"unknown advantage estimator '{config.advantage.estimator}'; valid: {', '.join(sorted(ESTIMATORS))}"
        )
    if config.runner.kind == "ray" and importlib.util.find_spec("prefect_ray") is None:
        raise ConfigError("runner 'ray' needs the ray extra: pip install 'mtrl[ray]'")
    if config.runner.kind == "ray" or config.ppo.nodes > 1:
        try:
            check_ray_address(config.runner.ray_address)
        except RayError as exc:
            raise ConfigError(str(exc)) from None
    try:
        check_starting_model(config)  # a template that hides the tools from the model fails here
    except ValueError as exc:  # ModelError too
        raise ConfigError(str(exc)) from None
