"""How a stage runs in the pipeline: one Prefect task for every stage, which reads the stage's
inputs from the store, calls its `run` (declared in its module, schemas/stage.py) and writes its
output as a new version (docs/architecture.md).

    rewarded = run_stage(config, "assign-rewards", {"execute-tools": last_turn})   # its manifest

finds the inputs it is not given through the lineage (the rollouts' policy, the KL reference),
resolves the stage's settings from the run config, and computes its version before it runs.
The store on disk is the truth:
- a version already on disk is never recomputed (the task returns at once), and
- Prefect's cache (keyed by version) is refreshed whenever that version is missing on disk,
  so a cache hit can never point at deleted data.
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch
from prefect import get_run_logger, task

from pipeline.monitoring import artifacts, progress
from pipeline.monitoring.artifacts import publish_stage
from pipeline.orchestration.stage_table import POLICY, STAGES, code_version, stage_version
from pipeline.store import lineage, retention
from pipeline.store.audit import audit_before_training
from pipeline.store.versions import Store
from runtime.hashing import version_key
from schemas.config import RunConfig
from schemas.features import token_counts
from schemas.manifest import Manifest
from schemas.stage import Settings, Stage
from stages.generate_rollouts.engine import ENGINE
from stages.policy.loading import load_tokenizer
from stages.registry import load_plugins

POLICY_CODE_VERSION = "1"  # the layout of a stored policy (a save_pretrained folder + optimiser state)


def settings_of(name: str, config: RunConfig) -> Settings:
    """A stage's settings in this run config, resolved once per process and config (the code of the
    task mix's environments is hashed when they are)."""
    return _settings(name, config.model_dump_json())


@functools.lru_cache(maxsize=64)
def _settings(name: str, config_json: str) -> Settings:
    config = RunConfig.model_validate_json(config_json)
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    return STAGES[name].settings.resolve(config)


class StoredInputs:
    """A stage's inputs (schemas.stage.Inputs) read from the store: each parent's data, checked
    against its digests, and the lineage queries a stage may ask."""

    def __init__(self, store: Store, stage: str, version: str, parents: dict[str, str]):
        self.store, self.stage, self.version, self.parents = store, stage, version, parents
        self._scratch: list[Path] = []

    def _stored(self, name: str) -> tuple[str, str]:
        return name.split("#")[0], self.parents[name]  # "policy#reference" is a policy

    def load(self, name: str) -> datasets.Dataset:
        return self.store.load(*self._stored(name))

    def folder(self, name: str) -> Path:
        stage, version = self._stored(name)
        if stage == POLICY:
            return self.store.policy_dir(version)
        self.store.load(stage, version)  # checks its files
        return self.store.path(stage, version)

    def manifest(self, name: str) -> Manifest:
        return self.store.manifest(*self._stored(name))

    def turns(self, name: str) -> datasets.Dataset:
        return lineage.load_turns(self.store, self.parents[name])

    def generating_policy(self, name: str) -> Manifest:
        return self.store.manifest(POLICY, lineage.generating_policy(self.store, *self._stored(name)))

    def scratch(self) -> Path:
        self._scratch.append(self.store.scratch(self.stage, self.version))
        return self._scratch[-1]

    def clean(self) -> None:
        for folder in self._scratch:
            shutil.rmtree(folder, ignore_errors=True)


def on_disk(store: Store, stage: str, version: str) -> bool:
    """Is this output whole on disk? The output of a stage that trains (ppo-update, sft) is its
    metrics dataset and the policy it wrote: a deleted policy folder is rebuilt by running the
    stage again."""
    if not store.exists(stage, version):
        return False
    return not STAGES[stage].writes_policy or store.exists(POLICY, store.manifest(stage, version).policy)


def write_trained_policy(
    store: Store, stage: str, version: str, save: Callable[[Path], dict[str, Any]], iteration: int | None
) -> tuple[str, dict[str, Any]]:
    """Store the policy a training stage's version produced; its version is named by that stage
    version alone. Returns the policy version and its files' digests (the stage's manifest
    records them: a rebuilt policy, after its folder was deleted, must be the same bytes, since
    later versions were made from the deleted ones)."""
    policy = version_key(POLICY, POLICY_CODE_VERSION, {}, {stage: version})
    manifest = {"parents": {stage: version}, "code_version": POLICY_CODE_VERSION, "iteration": iteration}
    written_before = store.manifest(stage, version).extra("policy_files") if store.exists(stage, version) else None
    written = store.write(POLICY, policy, save, manifest, expected_files=written_before)
    return policy, written.files


def progress_of(name: str, given: dict[str, Any]) -> Callable[[float], None]:
    """What the stage's share of work done moves: the stretch of a bar its caller gave (the
    iteration's generation bar, one stretch per turn), or a bar of its own, made when it first reports."""
    if given.get("progress"):
        return artifacts.stretch_of(**given["progress"])
    return artifacts.bar_of_its_own(name)


def write_version(
    name: str,
    config: RunConfig,
    version: str,
    parents: dict[str, str],
    position: dict[str, int] | None = None,
    given: dict[str, Any] | None = None,
) -> str:
    """The Prefect task every stage runs as (stage_task): run the stage and store its output as
    `version`, unless it is on disk. `given`: what the caller holds that never changes the output
    (the stretch of a progress bar a stage moves)."""
    stage, store, position, given = STAGES[name], Store(config.store.runs_dir), position or {}, given or {}
    if on_disk(store, name, version):
        return version
    settings = settings_of(name, config)
    unexpected = set(parents) - set(stage.input_names(settings))
    if unexpected:
        raise ValueError(f"{name} does not read {sorted(unexpected)}; its inputs: {stage.input_names(settings)}")
    # the iteration its rows belong to: its position, or its input dataset's
    inherited = [store.manifest(parent, v).iteration for parent, v in parents.items() if parent in STAGES]
    iteration = position.get("iteration", inherited[0] if inherited else None)
    audit = None
    if stage.audits:  # never train on a batch that fails the audit
        audit = audit_before_training(store, parents[stage.audits], config, config.seed + iteration).as_dict()
    inputs = StoredInputs(store, name, version, parents)
    extra = (
        {"report_progress": progress_of(name, given)}
        if "report_progress" in inspect.signature(stage.run).parameters
        else {}
    )
    started = time.time()
    try:
        output = stage.run(inputs, settings, **position, **extra)
        fields = {"iteration": iteration, **output.manifest}
        if output.save_policy is not None:
            policy, files = write_trained_policy(store, name, version, output.save_policy, fields["iteration"])
            fields.update(policy=policy, policy_files=files)
        manifest = {
            "parents": parents,
            "settings": settings.hashed(),
            "config": config.model_dump(mode="json"),  # the run's, which `mtrl stage` re-runs with
            **position,
            "code_version": code_version(name),
            "tokens": token_counts(output.dataset),
            "wall_s": round(time.time() - started, 3),
            # where it ran (runner), with how many CPU threads (runner.threads)
            "process": {"host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads()},
            **({"audit": audit} if audit is not None else {}),
            **fields,
        }
        store.write_dataset(name, version, output.dataset, manifest, stage.features)
    finally:
        inputs.clean()
    get_run_logger().info("%s/%s: %d rows in %.1f s", name, version, len(output.dataset), time.time() - started)
    publish_stage(store, name, version)
    if config.runner.kind == "ray":  # this may be a Ray worker: it can end before its artifacts are sent
        artifacts.flush()
    return version


# One Prefect task for every stage, run under the stage's name, cached by version, and its result
# (the version) JSON, never a pickle.
stage_task = task(
    write_version,
    cache_key_fn=lambda context, parameters: f"{parameters['name']}/{parameters['version']}",
    result_serializer="json",
    persist_result=True,
)


@functools.lru_cache(maxsize=64)
def configured_task(name: str, refresh_cache: bool, result_storage: Path) -> Any:
    """The stage task with these options: made once per process (a new Task reads its
    function's source, ~1.5 ms, and a default run calls a stage task ~110 times)."""
    return stage_task.with_options(name=name, refresh_cache=refresh_cache, result_storage=result_storage)


def run_stage(
    config: RunConfig,
    name: str,
    parents: dict[str, str],
    position: dict[str, int] | None = None,
    runner: Any | None = None,
    **given: Any,
) -> Manifest:
    """Run a stage on these inputs (in this process, or on `runner` for a stage that may run on Ray);
    the inputs it reads and is not given are found through the lineage (lineage.input_of); its
    version is known before it runs. Returns the version's manifest (its version, the rollouts a
    turn left active, the policy an update wrote, its metrics). `given`: see write_version."""
    stage, store, position = STAGES[name], Store(config.store.runs_dir), position or {}
    if stage.continues_optimizer is not None:
        config = optimizer_start(config, store, stage, parents, position)
    settings = settings_of(name, config)
    parents = {**{need: lineage.input_of(store, need, parents) for need in stage.input_names(settings)}, **parents}
    parents = {need: version for need, version in parents.items() if version is not None}
    version = stage_version(name, settings, parents, position)
    configured = configured_task(name, not on_disk(store, name, version), store.root / ".prefect" / "results")
    parameters = {"name": name, "config": config, "version": version, "parents": parents, "position": position}
    if given:
        parameters["given"] = given
    progress.stage_started(name, position)
    if runner is not None and stage.distributed:
        runner.submit(configured, parameters).result()
    else:
        configured(**parameters)
    made = store.manifest(name, version)
    progress.stage_finished(name, made)
    return made


def open_engine(config: RunConfig, policy: str) -> None:
    """Open (or update and verify) the process's generation engine for `policy` now, in this thread:
    the hf engine loads its model in model.dtype, and a load sets the process's default dtype, which
    must not change while another thread's forward passes run (a batch made beside an update)."""
    policy_dir = Store(config.store.runs_dir).policy_dir(policy)
    ENGINE.serving(policy_dir, load_tokenizer(str(policy_dir)), settings_of("generate-rollouts", config).engine)


def optimizer_start(
    config: RunConfig, store: Store, stage: Stage, parents: dict[str, str], position: dict[str, int]
) -> RunConfig:
    """The config a stage that continues its policy's AdamW state (ppo-update) runs with, where
    retention may have pruned that state. store.fresh_optimizer_if_pruned stays on only where it
    takes effect, since the stage's version hashes it: the state was pruned, the stage would
    continue it (no LoRA), and the version is not stored already (one stored was trained before
    the pruning, from the state: it is reused). Without the flag such an update is refused: a
    fresh AdamW in its place would silently train another update."""
    continuing = config
    if config.store.fresh_optimizer_if_pruned:
        continuing = config.with_overrides({"store.fresh_optimizer_if_pruned": False})
    policy = parents.get(POLICY) or lineage.input_of(store, POLICY, parents)
    pruned = retention.optimizer_state_gone(store, policy)
    settings = settings_of(stage.name, continuing)
    if pruned is None or not stage.continues_optimizer(settings):
        return continuing
    found = {need: lineage.input_of(store, need, parents) for need in stage.input_names(settings)}
    if on_disk(store, stage.name, stage_version(stage.name, settings, {**found, **parents}, position)):
        return continuing
    if not config.store.fresh_optimizer_if_pruned:
        raise pruned
    return config
