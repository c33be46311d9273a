"""The pre-flight checks: what a run's config names must exist before any work starts. Every
flow runs them first (pipeline/flows.py: a deployment's run starts there), and `mtrl` runs them
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
    from transformers import AutoConfig

    from pipeline.models import resolve_model_dir, starting_tokenizer
    from runtime.ray import RayError, check_ray_address
    from stages.compute_advantages import ESTIMATORS
    from stages.generate_rollouts import check_context_budget
    from stages.generate_rollouts.engine import ENGINES
    from stages.policy.loading import ModelError
    from stages.registry import Tasks, check_tasks, load_plugins
    from stages.sft import DemonstrationTasks, check_demonstrations, demonstrators

    try:
        load_plugins(config.task.plugins)
    except ImportError as exc:
        raise ConfigError(f"task.plugins: cannot import {exc.name!r}: {exc}") from None
    try:
        mixes = [Tasks.resolve(config)] + ([DemonstrationTasks.resolve(config)] if config.sft.steps > 0 else [])
        names = [name for tasks in mixes for name in tasks.names()]
        for setting in ("options", "tools"):
            strangers = sorted(set(getattr(config.task, setting)) - set(names))
            if strangers:
                raise ValueError(f"task.{setting} names {strangers}, which the run does not use (tasks: {names})")
        for tasks in mixes:
            check_tasks(tasks, config.tools.sandbox)
        if config.sft.steps > 0:
            check_demonstrations(demonstrators(mixes[-1]))
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
        model_config = AutoConfig.from_pretrained(resolve_model_dir(config.model.path))
        check_context_budget(config.generation.max_context_tokens, model_config.max_position_embeddings)
    except (ModelError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    try:
        starting_tokenizer(config)  # a template that hides the tools from the model fails here
    except ValueError as exc:  # ModelError too
        raise ConfigError(str(exc)) from None
