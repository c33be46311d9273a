"""Prefect flows of mtrl. They read like the data flow of one iteration (docs/architecture.md):

    policy vN ─┐
    tasks ─────┴─> [generate-rollouts]_t ─> [execute-tools]_t   for t = 0..T-1 (active rollouts)
                                         └─> [assign-rewards] ─> [compute-advantages] ─> [ppo-update] ─> policy vN+1

Every stage is a thin Prefect task around a pure function in stages/: it loads its inputs
from the store, calls the function and writes the dataset as a new version. A version is
computed before its task runs, from the stage table (pipeline/stage_table.py): the stage's
code, the config fields it depends on and its inputs' versions. The store on disk is the truth:
- a version already on disk is never recomputed (the task returns at once), and
- Prefect's cache (keyed by version) is refreshed whenever that version is missing on disk,
  so a cache hit can never point at deleted data.
"""

import functools
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import datasets
from prefect import flow, get_run_logger, task

from pipeline import artifacts
from pipeline.artifacts import generation_progress, ppo_progress, publish_stage, publish_summary, turn_progress
from pipeline.audit import audit_before_training
from pipeline.distributed import train_with_torchrun
from pipeline.evaluate import execute_turn, generate_turn
from pipeline.memory import peak_memory
from pipeline.models import resolve_model_dir
from pipeline.prefect_env import flow_heartbeats
from pipeline.runners import map_row_shards, stage_runner
from pipeline.stage_table import POLICY, STAGES
from pipeline.store import TMP_PREFIX, Store, copy_files, file_digests, version_key
from pipeline.task_mix import load_plugins, task_turn_limits, turn_limit
from schemas.config import RunConfig
from schemas.features import PPO_UPDATE, dataset_from_rows, token_counts
from stages import assign_rewards, compute_advantages, execute_tools, generate_rollouts, ppo_update
from stages.environments import ENVIRONMENTS
from stages.generate_rollouts.engine import GenerationEngine, open_engine
from stages.policy import load_tokenizer

POLICY_CODE_VERSION = "1"  # the layout of a stored policy (a save_pretrained folder + optimiser state)


def stage_version(config: RunConfig, stage: str, parents: dict[str, str], position: dict[str, int]) -> str:
    """The version a stage's output will have: known before it runs."""
    table = STAGES[stage]
    hashed = {
        "config": table.recorded_config(config),
        "derived": table.derived_values(config),
        "position": position,  # iteration and turn: the same config gives new rollouts each turn
    }
    return version_key(stage, table.code_version, hashed, parents)


# ---------------------------------------------------------------------------------------
# Runtime: the generation engine of the current policy, one per process
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def cached_tokenizer(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


_open_engine: dict[str, Any] = {}  # at most one: {"settings": ..., "model_dir": ..., "engine": ...}


def policy_engine(store: Store, config: RunConfig, policy_version: str) -> GenerationEngine:
    """The engine serving this policy: kept from turn to turn (it holds the rollouts' caches).
    When the next iteration's policy replaces it, an engine that reloads in place (a vLLM
    server's weight reload) loads the new checkpoint; any other is opened again on it."""
    model_dir = str(store.policy_dir(policy_version))
    settings = config.model_dump_json(include={"generation": {"engine"}, "model": {"dtype", "device"}, "vllm": True})
    if _open_engine.get("settings") == settings and _open_engine["model_dir"] != model_dir:
        if _open_engine["engine"].reloads_in_place:
            _open_engine["engine"].load_policy(model_dir)
            _open_engine["model_dir"] = model_dir
    if (_open_engine.get("settings"), _open_engine.get("model_dir")) != (settings, model_dir):
        close_engine()
        engine = open_engine(model_dir, cached_tokenizer(model_dir), config)
        _open_engine.update(settings=settings, model_dir=model_dir, engine=engine)
    return _open_engine["engine"]


def close_engine(unless_it_reloads: bool = False) -> None:
    """Close the open engine (a vLLM server mtrl started stops). After an iteration's turns an
    engine that would be reopened on the next policy anyway is closed at once, so that its
    memory (weights, KV cache) is free for the update."""
    if "engine" in _open_engine and not (unless_it_reloads and _open_engine["engine"].reloads_in_place):
        _open_engine.pop("engine").close()
        _open_engine.clear()


def import_base_policy(store: Store, config: RunConfig) -> str:
    """Store the starting model as the policy version of iteration -1. Its files are copied
    into the store, so the runs dir stands alone: moved or copied to another machine it keeps
    its lineage root. The version is the hash of the files, so the same model imported from
    anywhere is the same version."""
    model_dir = resolve_model_dir(config.model.path)
    load_tokenizer(model_dir)  # fail early, before any work, if it has no chat template
    digests = file_digests(model_dir)
    version = version_key(POLICY, POLICY_CODE_VERSION, {"source_files": digests}, {})

    def fill(tmp: Path) -> dict[str, Any]:
        copy_files(model_dir, tmp, digests)
        return {"imported_from": str(model_dir)}

    store.write(POLICY, version, fill, {"iteration": -1, "code_version": POLICY_CODE_VERSION})
    return version


# ---------------------------------------------------------------------------------------
# Stage tasks
# ---------------------------------------------------------------------------------------


def on_disk(store: Store, stage: str, version: str) -> bool:
    """Is this output whole on disk? ppo-update's output is its metrics dataset and the policy
    it wrote: a deleted policy folder is rebuilt by running the update again."""
    if not store.exists(stage, version):
        return False
    return stage != "ppo-update" or store.exists(POLICY, store.manifest(stage, version).policy)


def stage_task(stage: str) -> Callable[[Callable[..., tuple[datasets.Dataset, dict[str, Any]]]], Any]:
    """Turn `compute(store, config, parents, **position) -> (dataset, manifest fields)` into
    the Prefect task that writes one version of `stage`: it returns at once when the version
    is on disk, is cached by version, and its result (the version) is JSON, never a pickle."""

    def decorate(compute: Callable[..., tuple[datasets.Dataset, dict[str, Any]]]) -> Any:
        def write_version(
            config: RunConfig,
            version: str,
            parents: dict[str, str],
            position: dict[str, int] | None = None,
            progress_artifact: UUID | None = None,
        ) -> str:
            store = Store(config.store.runs_dir)
            if on_disk(store, stage, version):
                return version
            table = STAGES[stage]
            unexpected = set(parents) - set(table.inputs)
            if unexpected:
                raise ValueError(f"{stage} does not read {sorted(unexpected)}; its inputs: {table.inputs}")
            started = time.time()
            # generation updates the iteration's progress bar, which outlives its task runs
            progress = {"progress_artifact": progress_artifact} if progress_artifact else {}
            dataset, fields = compute(store, config, parents, **(position or {}), **progress)
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
                "process": {"host": socket.gethostname(), "pid": os.getpid()},  # where it ran (runner)
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
    progress_artifact: UUID | None = None,
) -> str:
    """Run a stage task on these inputs (in this process, or on `runner` for the stages the
    table marks distributed); its version is known before it runs."""
    stage = prefect_task.name
    position = position or {}
    version = stage_version(config, stage, parents, position)
    store = Store(config.store.runs_dir)
    configured = configured_task(prefect_task, not on_disk(store, stage, version), store.root / ".prefect" / "results")
    parameters = {"config": config, "version": version, "parents": parents, "position": position}
    if progress_artifact is not None:
        parameters["progress_artifact"] = progress_artifact
    if runner is not None and STAGES[stage].distributed:
        return runner.submit(configured, parameters).result()
    return configured(**parameters)


@stage_task("generate-rollouts")
def generate_rollouts_task(
    store: Store,
    config: RunConfig,
    parents: dict[str, str],
    iteration: int,
    turn: int,
    progress_artifact: UUID | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    policy_version, previous = parents[POLICY], parents.get("execute-tools")
    tokenizer = cached_tokenizer(str(store.policy_dir(policy_version)))
    history = store.load_turns(previous) if previous else None
    engine = policy_engine(store, config, policy_version)
    dataset, replay = generate_turn(
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
    return execute_turn(turns, cached_tokenizer(model_dir), config)


@stage_task("execute-tools")
def execute_tools_task(
    store: Store, config: RunConfig, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    turns = store.load("generate-rollouts", parents["generate-rollouts"])
    policy_version = store.manifest("generate-rollouts", parents["generate-rollouts"]).parents[POLICY]
    dataset = map_row_shards(execute_shard, turns, config.runner, str(store.policy_dir(policy_version)), config)
    return dataset, {"turn": turns[0]["turn"] if len(turns) else None, **execute_tools.turn_summary(dataset)}


@stage_task("assign-rewards")
def assign_rewards_task(
    store: Store, config: RunConfig, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    turns = store.load_turns(parents["execute-tools"])
    dataset = assign_rewards.assign_rewards(turns, ENVIRONMENTS, config.reward)
    return dataset, {"metrics": assign_rewards.rollout_metrics(dataset, task_turn_limits(config))}


def advantage_parents(config: RunConfig, store: Store, rewarded: str) -> dict[str, str]:
    """compute-advantages reads the generating policy (critic values) and the reference
    policy (KL penalty) only when the config uses them."""
    parents = {"assign-rewards": rewarded}
    policy = store.generating_policy("assign-rewards", rewarded)
    if config.advantage.estimator in compute_advantages.NEEDS_VALUES:
        parents[POLICY] = policy
    if config.ppo.kl_coef > 0:
        parents[f"{POLICY}#reference"] = store.reference_policy(policy)
    return parents


def update_parents(store: Store, advantaged: str) -> tuple[dict[str, str], dict[str, int]]:
    """ppo-update trains the policy that generated the rollouts; its position is their iteration."""
    rollouts = store.ancestor("compute-advantages", advantaged, "generate-rollouts")
    return {"compute-advantages": advantaged, POLICY: rollouts.parents[POLICY]}, {"iteration": rollouts.iteration}


@stage_task("compute-advantages")
def compute_advantages_task(
    store: Store, config: RunConfig, parents: dict[str, str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    turns = store.load("assign-rewards", parents["assign-rewards"])
    reference = parents.get(f"{POLICY}#reference")
    # the first iteration's rollouts come from the reference policy itself
    reference_generated = (
        reference == store.generating_policy("assign-rewards", parents["assign-rewards"])
        and config.exact_generation_logprobs()
    )
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
    return dataset, {
        "metrics": compute_advantages.advantage_metrics(dataset),
        "reference_logprobs": reference_logprobs,
    }


@stage_task("ppo-update")
def ppo_update_task(
    store: Store, config: RunConfig, parents: dict[str, str], iteration: int
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Train the policy on the iteration's rollouts (in this process, or as ppo.world_size
    processes under torchrun, here or on ppo.nodes Ray nodes); write the next policy, then the metrics."""
    turns = store.load("compute-advantages", parents["compute-advantages"])
    report = audit_before_training(store, parents["compute-advantages"], turns, config, seed=config.seed + iteration)
    recompute = config.recomputes_old_logprobs()  # exact generation logprobs are the old ones (the audit re-scored)
    ppo = config.ppo.model_copy(update={"recompute_old_logprobs": recompute})
    version = stage_version(config, "ppo-update", parents, {"iteration": iteration})
    training = {
        "train_critic": config.advantage.estimator in compute_advantages.NEEDS_VALUES,
        "seed": config.seed + iteration,
        "report_progress": ppo_progress(iteration),
    }
    work = store.root / "ppo-update" / f"{TMP_PREFIX}{version}-train-{os.getpid()}-{uuid4().hex[:8]}"
    placement: dict[str, Any] = {}  # several processes: where each rank ran
    try:
        with peak_memory() as memory:  # this stage's own peak (resident set; CUDA allocator)
            if config.ppo.world_size == 1:
                trained = ppo_update.train_policy(
                    turns,
                    store.policy_dir(parents[POLICY]),
                    config=ppo,
                    temperature=config.generation.temperature,
                    device=config.model.device,
                    **training,
                )
            else:
                trained = train_with_torchrun(
                    config.model_copy(update={"ppo": ppo}),
                    turns_dir=store.path("compute-advantages", parents["compute-advantages"]),
                    policy_dir=store.policy_dir(parents[POLICY]),
                    work=work,
                    log=get_run_logger().info,
                    **training,
                )
                # the largest rank's peak, as one process reports its own; then each rank's
                ranks = trained.memory_per_rank
                memory = {name: max(rank[name] for rank in ranks) for name in ("rss_before_mb", "peak_rss_mb")}
                memory["ranks"] = ranks
                placement["nodes"] = trained.nodes
        next_policy = version_key(POLICY, POLICY_CODE_VERSION, {}, {"ppo-update": version})
        policy_manifest = {
            "parents": {"ppo-update": version},
            "code_version": POLICY_CODE_VERSION,
            "iteration": iteration,
        }
        # a rebuilt policy (its folder was deleted) must be the bytes that later versions were made from
        written_before = (
            store.manifest("ppo-update", version).extra("policy_files") if store.exists("ppo-update", version) else None
        )
        written = store.write(POLICY, next_policy, trained.save, policy_manifest, expected_files=written_before)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dataset_from_rows(trained.metrics, PPO_UPDATE), {
        "metrics": ppo_update.metrics_summary(trained.metrics),
        "audit": report.as_dict(),
        "memory": memory,
        "optimizer_state_restored": trained.optimizer_state_restored,
        "old_logprobs": "recomputed" if recompute else "generation",
        "policy": next_policy,
        "policy_files": written.files,
        **placement,
    }


# ---------------------------------------------------------------------------------------
# Flows
# ---------------------------------------------------------------------------------------


@flow(name="rl-iteration")
@artifacts.sent_before_exit
def rl_iteration(
    config: RunConfig, iteration: int | None = None, policy_version: str | None = None, plot: bool = True
) -> dict[str, Any]:
    """One RL iteration. Without arguments: the next iteration from the store's newest policy
    (what a scheduled deployment run does). One iteration at a time per store: a file lock.
    `plot`: draw the learning curve into the summary artifact (rl-training: at its last iteration)."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock(), stage_runner(config.runner) as runner:
        store.clean_stale_tmp()
        if policy_version is None:
            policy_version = store.latest_policy() or import_base_policy(store, config)
        if iteration is None:
            iteration = store.manifest(POLICY, policy_version).iteration + 1

        previous: str | None = None  # the execute-tools version of the last turn
        generation = generation_progress(iteration, turn_limit(config))
        for turn in range(turn_limit(config)):
            generated = run_stage(
                generate_rollouts_task,
                config,
                {POLICY: policy_version, **({"execute-tools": previous} if previous else {})},
                position={"iteration": iteration, "turn": turn},
                progress_artifact=generation.artifact_id,
            )
            previous = run_stage(execute_tools_task, config, {"generate-rollouts": generated}, runner=runner)
            if store.manifest("execute-tools", previous).active == 0:
                break
        close_engine(unless_it_reloads=True)
        generation.finish(f"iteration {iteration}: all rollouts stopped after {turn + 1} turn(s)")
        rewarded = run_stage(assign_rewards_task, config, {"execute-tools": previous}, runner=runner)
        advantaged = run_stage(compute_advantages_task, config, advantage_parents(config, store, rewarded))
        updated = run_stage(ppo_update_task, config, *update_parents(store, advantaged))
        next_policy = store.manifest("ppo-update", updated).policy
        metrics = store.manifest("assign-rewards", rewarded).metrics
        get_run_logger().info(
            "iteration %d: reward %.3f, success %.2f",
            iteration,
            metrics["reward_mean"] or 0,
            metrics["success_rate"] or 0,
        )
        publish_summary(store, next_policy, plot=plot)
    return {
        "iteration": iteration,
        "policy": policy_version,
        "next_policy": next_policy,
        "versions": {
            "execute-tools": store.turns_of(previous),
            "assign-rewards": rewarded,
            "compute-advantages": advantaged,
            "ppo-update": updated,
        },
        "metrics": metrics,
    }


@flow(name="rl-training")
@artifacts.sent_before_exit
def rl_training(config: RunConfig) -> list[dict[str, Any]]:
    """config.iterations RL iterations from the starting model, each one an rl-iteration run."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock():
        policy_version = import_base_policy(store, config)
    results = []
    # one Ray for all iterations (each iteration reuses it); the iterations run in this
    # process, so this run's heartbeat covers them (prefect_env.flow_heartbeats)
    with stage_runner(config.runner), flow_heartbeats(enabled=False):
        try:
            for iteration in range(config.iterations):
                last = iteration == config.iterations - 1
                results.append(rl_iteration(config, iteration=iteration, policy_version=policy_version, plot=last))
                policy_version = results[-1]["next_policy"]
        finally:
            close_engine()
    return results


@flow(name="rl-stage")
@artifacts.sent_before_exit
def rerun_stage(config: RunConfig, stage: str, source: str) -> str:
    """Re-run one stage on a stored input (e.g. re-score rewards, or A/B two estimators on the
    same rollouts); writes a new version beside the old one, or finds it already stored."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    source_stage, source_version = store.resolve(source)
    rerunnable = {name: table.rerun_from for name, table in STAGES.items() if table.rerun_from}
    if rerunnable.get(stage) != source_stage:
        choices = ", ".join(f"{name} --from {source}/VERSION" for name, source in rerunnable.items())
        raise ValueError(f"`mtrl stage {stage}` cannot run on {source_stage}/VERSION; valid: {choices}")
    with store.lock(), stage_runner(config.runner) as runner:
        if stage == "assign-rewards":
            return run_stage(assign_rewards_task, config, {"execute-tools": source_version}, runner=runner)
        if stage == "compute-advantages":
            return run_stage(compute_advantages_task, config, advantage_parents(config, store, source_version))
        return run_stage(ppo_update_task, config, *update_parents(store, source_version))
