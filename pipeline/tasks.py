"""The Prefect task of each stage: load its inputs from the store, call its pure function in
stages/, write its dataset as a new version (docs/architecture.md).

A version is known before its task runs (stage_version: the stage table's config fields,
derived values and code, the position, the input versions), and the task is passed it. The
store on disk is the truth:
- a version already on disk is never recomputed (the task returns at once), and
- Prefect's cache (keyed by version) is refreshed whenever that version is missing on disk,
  so a cache hit can never point at deleted data.

The stages that run on one stored input (assign-rewards, compute-advantages, ppo-update) find
their other inputs through the lineage (ON_ONE_INPUT): the flow and `mtrl stage` call them the
same way.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import datasets
import torch
from prefect import get_run_logger, task

from pipeline import artifacts, lineage, retention
from pipeline.artifacts import ppo_progress, publish_stage, turn_progress
from pipeline.audit import AuditReport, audit_before_training
from pipeline.launch import train_with_torchrun
from pipeline.models import resolve_model, starting_tokenizer
from pipeline.runners import map_row_shards
from pipeline.stage_table import POLICY, SHAPING_LIBRARIES, STAGES, library_versions
from pipeline.store import TMP_PREFIX, Store, copy_files
from runtime.hashing import file_digests, version_key
from runtime.memory import peak_memory
from runtime.phases import PHASES
from schemas.config import RunConfig
from schemas.features import PPO_UPDATE, SFT, dataset_from_rows, token_counts
from schemas.token_stream import chat_template_hash
from stages import assign_rewards, compute_advantages, execute_tools, generate_rollouts, ppo_update, sft
from stages.generate_rollouts.engine import GenerationEngine, open_engine
from stages.policy import add_counts, counting_passes, load_tokenizer, parameter_count, training_memory
from stages.registry import run_environments
from stages.task_mix import load_plugins, turn_limit

POLICY_CODE_VERSION = "1"  # the layout of a stored policy (a save_pretrained folder + optimiser state)


def stage_version(config: RunConfig, stage: str, parents: dict[str, str], position: dict[str, int]) -> str:
    """The version a stage's output will have: known before it runs."""
    table = STAGES[stage]
    hashed = {
        "config": table.recorded_config(config),
        "derived": table.derived_values(config),
        "position": position,  # iteration and turn: the same config gives new rollouts each turn
        "libraries": library_versions(SHAPING_LIBRARIES),
    }
    return version_key(stage, table.code_version, hashed, parents)


def import_base_policy(store: Store, config: RunConfig) -> str:
    """Store the starting model as the policy version of iteration -1. Its files are copied
    into the store, so the runs dir stands alone: moved or copied to another machine it keeps
    its lineage root. The version is the hash of the files, so the same model imported from
    anywhere is the same version. A GGUF file is imported as the folder it converts to
    (pipeline/models.py), and the manifest names the file."""
    model = resolve_model(config.model.path)
    tokenizer = starting_tokenizer(config)  # fail early, before any work, on a template that hides the tools
    digests = file_digests(model.folder)
    identity: dict[str, Any] = {"source_files": digests}
    if config.model.chat_template is not None:  # the same files with another template: another policy
        identity["chat_template_sha256"] = chat_template_hash(tokenizer)
    version = version_key(POLICY, POLICY_CODE_VERSION, identity, {})

    def fill(tmp: Path) -> dict[str, Any]:
        copy_files(model.folder, tmp, digests)
        if config.model.chat_template is None:
            return {"imported_from": str(model.source)}
        tokenizer.save_pretrained(tmp)  # stored with the policy: every stage reads the template from there
        return {"imported_from": str(model.source), "chat_template": config.model.chat_template}

    store.write(POLICY, version, fill, {"iteration": -1, "code_version": POLICY_CODE_VERSION})
    return version


# ---------------------------------------------------------------------------------------
# The generation engine of the current policy, one per process
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def cached_tokenizer(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


class PolicyEngine:
    """The engine serving the current policy, kept from turn to turn (it holds the rollouts'
    caches). When the next iteration's policy replaces it, an engine that reloads in place (a
    vLLM server's weight reload) loads the new checkpoint; any other is opened again on it."""

    def __init__(self) -> None:
        self.engine: GenerationEngine | None = None
        self.settings: str | None = None  # the config fields an open engine was opened with
        self.model_dir: str | None = None

    def serving(self, store: Store, config: RunConfig, policy_version: str) -> GenerationEngine:
        model_dir = str(store.policy_dir(policy_version))
        settings = config.model_dump_json(
            include={"generation": {"engine"}, "model": {"dtype", "device"}, "vllm": True}
        )
        if self.engine is not None and self.settings == settings and self.model_dir != model_dir:
            if self.engine.reloads_in_place:
                self.engine.load_policy(model_dir)
                self.model_dir = model_dir
        if self.engine is None or (self.settings, self.model_dir) != (settings, model_dir):
            self.close()
            self.engine = open_engine(model_dir, cached_tokenizer(model_dir), config)
            self.settings, self.model_dir = settings, model_dir
        return self.engine

    def close(self, unless_it_reloads: bool = False) -> None:
        """Close the open engine (a vLLM server mtrl started stops). After an iteration's turns an
        engine that would be reopened on the next policy anyway is closed at once, so that its
        memory (weights, KV cache) is free for the update."""
        if self.engine is not None and not (unless_it_reloads and self.engine.reloads_in_place):
            self.engine.close()
            self.engine = self.settings = self.model_dir = None


POLICY_ENGINE = PolicyEngine()  # the stage tasks run in the flow's process share it


# ---------------------------------------------------------------------------------------
# Stage tasks
# ---------------------------------------------------------------------------------------


def on_disk(store: Store, stage: str, version: str) -> bool:
    """Is this output whole on disk? The output of a stage that trains (ppo-update, sft) is its
    metrics dataset and the policy it wrote: a deleted policy folder is rebuilt by running the
    stage again."""
    if not store.exists(stage, version):
        return False
    return not STAGES[stage].writes_policy or store.exists(POLICY, store.manifest(stage, version).policy)


def write_trained_policy(
    store: Store, stage: str, version: str, save: Callable[[Path], dict[str, Any]], iteration: int
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


Compute = Callable[..., tuple[datasets.Dataset, dict[str, Any]]]


def stage_task(stage: str) -> Callable[[Compute], Any]:
    """Turn `compute(store, config, version, parents, **position, **given) -> (dataset, manifest
    fields)` into the Prefect task that writes that version of `stage`: it returns at once when the
    version is on disk, is cached by version, and its result (the version) is JSON, never a pickle.
    `given`: what the caller already holds that the stage would otherwise compute again, which
    never changes its output (generation's progress bar, ppo-update's audit report)."""

    def decorate(compute: Compute) -> Any:
        def write_version(
            config: RunConfig,
            version: str,
            parents: dict[str, str],
            position: dict[str, int] | None = None,
            given: dict[str, Any] | None = None,
        ) -> str:
            store = Store(config.store.runs_dir)
            if on_disk(store, stage, version):
                return version
            table = STAGES[stage]
            unexpected = set(parents) - set(table.inputs)
            if unexpected:
                raise ValueError(f"{stage} does not read {sorted(unexpected)}; its inputs: {table.inputs}")
            started = time.time()
            dataset, fields = compute(store, config, version, parents, **(position or {}), **(given or {}))
            # the iteration its rows belong to: its position, or its input dataset's
            inherited = [store.manifest(name, parent).iteration for name, parent in parents.items() if name in STAGES]
            manifest = {
                "parents": parents,
                "config": table.recorded_config(config),
                "derived": table.derived_values(config),
                "iteration": inherited[0] if inherited else None,
                **(position or {}),
                "code_version": table.code_version,
                "tokens": token_counts(dataset),
                "wall_s": round(time.time() - started, 3),
                # where it ran (runner), with how many CPU threads (runner.threads)
                "process": {"host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads()},
                **fields,
            }
            store.write_dataset(stage, version, dataset, manifest)
            get_run_logger().info("%s/%s: %d rows in %.1f s", stage, version, len(dataset), time.time() - started)
            publish_stage(store, stage, version)
            if config.runner.kind == "ray":  # this may be a Ray worker: it can end before its artifacts are sent
                artifacts.flush()
            return version

        return task(
            write_version,
            name=stage,
            cache_key_fn=lambda context, parameters: f"{stage}/{parameters['version']}",
            result_serializer="json",
            persist_result=True,
        )

    return decorate


@functools.lru_cache(maxsize=64)
def configured_task(prefect_task: Any, refresh_cache: bool, result_storage: Path) -> Any:
    """The stage task with these options: made once per process (a new Task reads its
    function's source, ~1.5 ms, and a default run calls a stage task ~110 times)."""
    return prefect_task.with_options(refresh_cache=refresh_cache, result_storage=result_storage)


def run_stage(
    prefect_task: Any,
    config: RunConfig,
    parents: dict[str, str],
    position: dict[str, int] | None = None,
    runner: Any | None = None,
    given: dict[str, Any] | None = None,
) -> str:
    """Run a stage task on these inputs (in this process, or on `runner` for the stages the
    table marks distributed); its version is known before it runs."""
    stage = prefect_task.name
    position = position or {}
    version = stage_version(config, stage, parents, position)
    store = Store(config.store.runs_dir)
    configured = configured_task(prefect_task, not on_disk(store, stage, version), store.root / ".prefect" / "results")
    parameters = {"config": config, "version": version, "parents": parents, "position": position}
    if given:
        parameters["given"] = given
    if runner is not None and STAGES[stage].distributed:
        return runner.submit(configured, parameters).result()
    return configured(**parameters)


@stage_task("generate-rollouts")
def generate_rollouts_task(
    store: Store,
    config: RunConfig,
    version: str,
    parents: dict[str, str],
    iteration: int,
    turn: int,
    progress_artifact: UUID | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    policy_version, previous = parents[POLICY], parents.get("execute-tools")
    tokenizer = cached_tokenizer(str(store.policy_dir(policy_version)))
    history = lineage.load_turns(store, previous) if previous else None
    engine = POLICY_ENGINE.serving(store, config, policy_version)
    dataset, replay = generate_rollouts.generate_turn(
        engine,
        tokenizer,
        config,
        iteration=iteration,
        turn=turn,
        policy_version=policy_version,
        history=history,
        report_progress=turn_progress(progress_artifact, iteration, turn, turn_limit(config)),
    )
    provenance = generate_rollouts.provenance(config.generation, config.seed, tokenizer) | {"engine": engine.describe()}
    # a cold engine (a resumed run) replays the earlier turns first; 0.0 means bit-identical
    return dataset, {"provenance": provenance, "replay": replay}


def execute_shard(turns: datasets.Dataset, model_dir: str, config: RunConfig) -> datasets.Dataset:
    """execute-tools on some of a turn's rows (all of them, or one Ray shard)."""
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    with PHASES.span("stage_compute"):
        return execute_tools.execute_turn(turns, cached_tokenizer(model_dir), config)


@stage_task("execute-tools")
def execute_tools_task(
    store: Store, config: RunConfig, version: str, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    turns = store.load("generate-rollouts", parents["generate-rollouts"])
    policy_version = store.manifest("generate-rollouts", parents["generate-rollouts"]).parents[POLICY]
    dataset = map_row_shards(execute_shard, turns, config.runner, str(store.policy_dir(policy_version)), config)
    return dataset, {"turn": turns[0]["turn"] if len(turns) else None, **execute_tools.turn_summary(dataset, config)}


@stage_task("assign-rewards")
def assign_rewards_task(
    store: Store, config: RunConfig, version: str, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    turns = lineage.load_turns(store, parents["execute-tools"])
    tasks = run_environments(config)
    with PHASES.span("stage_compute"):
        dataset = assign_rewards.assign_rewards(turns, tasks, config.reward)
    return dataset, {"metrics": assign_rewards.rollout_metrics(dataset, tasks, config.task.max_turns)}


@stage_task("compute-advantages")
def compute_advantages_task(
    store: Store, config: RunConfig, version: str, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    turns = store.load("assign-rewards", parents["assign-rewards"])
    reference = parents.get(f"{POLICY}#reference")
    # the first iteration's rollouts come from the reference policy itself
    reference_generated = (
        reference == lineage.generating_policy(store, "assign-rewards", parents["assign-rewards"])
        and config.exact_generation_logprobs()
    )
    with counting_passes() as passes, PHASES.span("stage_compute"):
        scored = compute_advantages.score_with_policies(
            turns,
            critic_dir=store.policy_dir(parents[POLICY]) if POLICY in parents else None,
            reference_dir=store.policy_dir(reference) if reference else None,
            ppo=config.ppo,
            temperature=config.generation.temperature,
            device=config.model.device,
            reference_generated=reference_generated,
        )
    dataset = compute_advantages.compute_advantages(turns, config.advantage, **scored)
    reference_logprobs = None if reference is None else "generation" if reference_generated else "scored"
    # passes: the reference and value passes; one is absent where no setting needs it (no KL term,
    # no critic, the first iteration's exact generation logprobs)
    return dataset, {
        "metrics": compute_advantages.advantage_metrics(dataset),
        "reference_logprobs": reference_logprobs,
        "passes": passes,
    }


AHEAD_THREAD = "experience-ahead"  # the thread of pipeline.flows.in_background: the next batch, made beside ppo-update


@stage_task("ppo-update")
def ppo_update_task(
    store: Store,
    config: RunConfig,
    version: str,
    parents: dict[str, str],
    iteration: int,
    audit: dict[str, Any] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Train the policy on the iteration's rollouts (in this process, or as ppo.world_size
    processes under torchrun, here or on ppo.nodes Ray nodes); write the next policy, then the
    metrics. `audit`: the batch's passed audit (the flow audits a batch as soon as it is made);
    without it the batch is audited here, and one that fails is never trained on."""
    if audit is None:
        audit = audit_before_training(store, parents["compute-advantages"], config, config.seed + iteration).as_dict()
    turns = store.load("compute-advantages", parents["compute-advantages"])
    generating = lineage.generating_policy(store, "compute-advantages", parents["compute-advantages"])
    # Exact generation logprobs of the trained policy are its old logprobs (the audit re-scored them).
    # Rollouts of an older policy (ppo.max_staleness) are the decoupled case: the ratio is taken
    # against the trained policy's recomputed logprobs, the TIS weight corrects from the generating one.
    stale = generating != parents[POLICY]
    recompute = config.recomputes_old_logprobs() or stale
    policy_dir = store.policy_dir(parents[POLICY])  # its files checked once, here
    parameters = parameter_count(policy_dir)
    ppo = config.ppo.model_copy(update={"recompute_old_logprobs": recompute})
    ppo = training_memory(ppo, policy_dir, config.model.device)
    training = {
        "train_critic": config.advantage.estimator in compute_advantages.NEEDS_VALUES,
        "seed": config.seed + iteration,
        "report_progress": ppo_progress(iteration),
    }
    work = store.root / "ppo-update" / f"{TMP_PREFIX}{version}-train-{os.getpid()}-{uuid4().hex[:8]}"
    placement: dict[str, Any] = {}  # several processes: where each rank ran
    try:
        # the resident set is the process's: with ppo.max_staleness the next batch, made in a thread
        # beside this one, counts too (memory.scope says so; torchrun's ranks measure only themselves)
        beside = [thread.name for thread in threading.enumerate() if thread.name.startswith(AHEAD_THREAD)]
        with peak_memory() as memory, counting_passes() as passes, PHASES.span("stage_compute"):
            memory["scope"] = "the process, with the next batch made beside it" if beside else "this stage"
            if config.ppo.world_size == 1:
                trained = ppo_update.train_policy(
                    turns,
                    policy_dir,
                    config=ppo,
                    temperature=config.generation.temperature,
                    device=config.model.device,
                    **training,
                )
            else:
                trained = train_with_torchrun(
                    config.model_copy(update={"ppo": ppo}),
                    turns_dir=store.path("compute-advantages", parents["compute-advantages"]),
                    policy_dir=policy_dir,
                    work=work,
                    log=get_run_logger().info,
                    **training,
                )
                # the largest rank's peak, as one process reports its own; then each rank's
                ranks = trained.memory_per_rank
                for rank in ranks:  # each rank's passes over its share
                    add_counts(passes, rank.pop("passes"))
                memory = {name: max(rank[name] for rank in ranks) for name in ("rss_before_mb", "peak_rss_mb")}
                memory.update(ranks=ranks, scope="the largest rank")
                placement["nodes"] = trained.nodes
        next_policy, policy_files = write_trained_policy(store, "ppo-update", version, trained.save, iteration)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dataset_from_rows(trained.metrics, PPO_UPDATE), {
        "metrics": ppo_update.metrics_summary(trained.metrics),
        "audit": audit,
        "memory": memory,
        # what ppo.gradient_checkpointing / max_tokens_per_micro_batch were (null: chosen by the model's size)
        "memory_settings": {
            "parameters": parameters,
            **ppo.model_dump(include={"gradient_checkpointing", "max_tokens_per_micro_batch"}),
        },
        "optimizer_state_restored": trained.optimizer_state_restored,
        "old_logprobs": "recomputed" if recompute else "generation",
        # every pass over the policy, by kind, with its tokens (all ranks'; the audit's re-score is in
        # "audit"); a pass a setting does not need is absent (old logprobs when the generation ones are
        # exact, the recomputed forward without activation checkpointing)
        "passes": passes,
        "staleness": lineage.staleness(store, generating, trained=parents[POLICY]),
        "policy": next_policy,
        "policy_files": policy_files,
        **placement,
    }


@stage_task("sft")
def sft_task(
    store: Store, config: RunConfig, version: str, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The warm start: fine-tune the starting policy on demonstrations and write the result as a
    policy of iteration -1 (RL's iteration 0 trains it), then the per-step metrics."""
    load_plugins(config.task.plugins)  # the demonstrations' environments may be a plugin's
    policy_dir = store.policy_dir(parents[POLICY])  # its files checked once, here
    chosen = training_memory(config.sft, policy_dir, config.model.device)
    with peak_memory() as memory:
        trained = sft.supervised_fine_tune(
            policy_dir,
            config=chosen,
            tasks=sft.demonstrators(config),
            seed=config.seed,
            enable_thinking=config.generation.enable_thinking,
            device=config.model.device,
        )
    policy, policy_files = write_trained_policy(store, "sft", version, trained.save, iteration=-1)
    return dataset_from_rows(trained.metrics, SFT), {
        "iteration": -1,
        "metrics": sft.metrics_summary(trained.metrics),
        "memory": memory,
        # what sft.gradient_checkpointing / max_tokens_per_micro_batch were (null: chosen by the model's size)
        "memory_settings": chosen.model_dump(include={"gradient_checkpointing", "max_tokens_per_micro_batch"}),
        "policy": policy,
        "policy_files": policy_files,
    }


def starting_policy(store: Store, config: RunConfig) -> str:
    """The policy RL starts from (and the KL reference): the imported model, or with sft.steps > 0
    its warm start (a stored version: the same settings on the same model train once)."""
    base = import_base_policy(store, config)
    if config.sft.steps == 0:
        return base
    return store.manifest("sft", run_stage(sft_task, config, {POLICY: base})).policy


# ---------------------------------------------------------------------------------------
# One verb per stage: each builds its stage's parents and runs its task; the flows and
# `mtrl stage` (on one stored input, the stage table's rerun_from) call the same verbs
# ---------------------------------------------------------------------------------------


def generate(
    config: RunConfig,
    policy: str,
    previous_turn: str | None,
    iteration: int,
    turn: int,
    progress_artifact: UUID | None = None,
) -> str:
    """generate-rollouts: one turn of the iteration's active rollouts (turn 0: new ones) by `policy`,
    after the previous turn's execute-tools version."""
    parents = {POLICY: policy, **({"execute-tools": previous_turn} if previous_turn else {})}
    given = {"progress_artifact": progress_artifact} if progress_artifact else {}
    return run_stage(generate_rollouts_task, config, parents, {"iteration": iteration, "turn": turn}, given=given)


def execute(config: RunConfig, generated: str, runner: Any | None = None) -> str:
    """execute-tools on one turn's generate-rollouts version (its rows hold the environments' state
    so far: a stateful game is made again from it)."""
    return run_stage(execute_tools_task, config, {"generate-rollouts": generated}, runner=runner)


def reward(config: RunConfig, last_turn: str, runner: Any | None = None) -> str:
    """assign-rewards on the last turn's execute-tools version (it names the earlier ones)."""
    return run_stage(assign_rewards_task, config, {"execute-tools": last_turn}, runner=runner)


def advantage(config: RunConfig, rewarded: str, runner: Any | None = None) -> str:
    """compute-advantages on an assign-rewards version; it reads the generating policy (critic
    values) and the reference policy (KL penalty) only when the config uses them."""
    store = Store(config.store.runs_dir)
    parents = {"assign-rewards": rewarded}
    policy = lineage.generating_policy(store, "assign-rewards", rewarded)
    if config.advantage.estimator in compute_advantages.NEEDS_VALUES:
        parents[POLICY] = policy
    if config.ppo.kl_coef > 0:
        parents[f"{POLICY}#reference"] = lineage.reference_policy(store, policy)
    return run_stage(compute_advantages_task, config, parents, runner=runner)


def update(
    config: RunConfig,
    advantaged: str,
    runner: Any | None = None,
    policy: str | None = None,
    audit: AuditReport | None = None,
) -> str:
    """ppo-update of `policy` on a compute-advantages version: `policy` is the newest one of the run,
    which with ppo.max_staleness > 0 may be newer than the policy that generated the rollouts (null:
    that one, the synchronous loop). Its position is the rollouts' iteration. `audit`: the batch's
    audit report, passed by the flow that made the batch; without it the task audits the batch."""
    store = Store(config.store.runs_dir)
    rollouts = store.ancestor("compute-advantages", advantaged, "generate-rollouts")
    if policy is not None and policy != rollouts.parents[POLICY] and config.ppo.recompute_old_logprobs is False:
        raise ValueError(
            f"ppo-update of policy {policy} on rollouts of policy {rollouts.parents[POLICY]} needs the trained "
            "policy's own old logprobs: leave ppo.recompute_old_logprobs null"
        )
    parents = {"compute-advantages": advantaged, POLICY: policy or rollouts.parents[POLICY]}
    position = {"iteration": rollouts.iteration}
    config = optimizer_start(config, store, parents, position)
    return run_stage(ppo_update_task, config, parents, position, given={"audit": audit.as_dict() if audit else None})


def optimizer_start(config: RunConfig, store: Store, parents: dict[str, str], position: dict[str, int]) -> RunConfig:
    """The config ppo-update runs with, where retention may have pruned the AdamW state of the
    policy it trains. store.fresh_optimizer_if_pruned stays on only where it takes effect, since
    ppo-update's version hashes it (stage_table: the derived `fresh_optimizer`): the state was
    pruned, the update would continue it (no LoRA), and the update is not stored already (one
    stored was trained before the pruning, from the state: it is reused). Without the flag such
    an update is refused: a fresh AdamW in its place would silently train another update."""
    continuing = config
    if config.store.fresh_optimizer_if_pruned:
        continuing = config.with_overrides({"store.fresh_optimizer_if_pruned": False})
    pruned = retention.pruned_optimizer_state(store, parents[POLICY])
    if pruned is None or config.ppo.lora_rank > 0:
        return continuing
    if on_disk(store, "ppo-update", stage_version(continuing, "ppo-update", parents, position)):
        return continuing
    if not config.store.fresh_optimizer_if_pruned:
        raise retention.PrunedStateError(parents[POLICY], store.manifest(POLICY, parents[POLICY]).iteration, pruned)
    return config


# stage -> its verb on the one stored input the stage table names (rerun_from): `mtrl stage`
ON_ONE_INPUT: dict[str, Callable[..., str]] = {
    "execute-tools": execute,
    "assign-rewards": reward,
    "compute-advantages": advantage,
    "ppo-update": update,
}
