"""Prefect flows of mtrl. They read like the diagram in DESIGN.md:

    policy vN ─┐
    tasks ─────┴─> [generate-rollouts]_t ─> [execute-tools]_t   for t = 0..T-1 (active rollouts)
                                         └─> [assign-rewards] ─> [compute-advantages] ─> [ppo-update] ─> policy vN+1

Every stage is a thin Prefect task around a pure function in stages/. A task returns the
*version* of the dataset it wrote. Versions are computed before a task runs, from its code,
its config section and its inputs' versions; the store on disk is the truth:
- a version already on disk is never recomputed (the task returns at once), and
- Prefect's cache (keyed by version) is refreshed whenever that version is missing on disk,
  so a cache hit can never point at deleted data.
"""

import functools
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline.audit import AuditError, audit
from pipeline.episodes import (
    environment_code,
    execute_turn,
    generate_turn,
    load_plugins,
    rollout_metrics,
    task_turn_limits,
    turn_limit,
)
from pipeline.memory import peak_memory
from pipeline.models import eos_token_ids, load_model, load_tokenizer, pick_device, resolve_model_dir
from pipeline.report import write_report
from pipeline.runners import DISTRIBUTED_STAGES, map_row_shards, stage_runner
from pipeline.store import POLICY, Store, file_digests, source_version, version_key
from schemas.config import RunConfig
from schemas.features import PPO_UPDATE, dataset_from_rows, token_counts
from schemas.token_stream import CONTEXT_CONVENTION, chat_template_hash
from stages import assign_rewards, compute_advantages, execute_tools, generate_rollouts, ppo_update

ROOT = Path(__file__).resolve().parent.parent
_SCHEMAS = [ROOT / "schemas" / "features.py", ROOT / "schemas" / "token_stream.py"]
CODE_VERSIONS = {
    "generate-rollouts": source_version(ROOT / "stages" / "generate_rollouts.py", *_SCHEMAS),
    # environments (and user plugins) enter the versions through environment_code()
    "execute-tools": source_version(*sorted((ROOT / "stages" / "execute_tools").glob("*.py")), *_SCHEMAS),
    "assign-rewards": source_version(ROOT / "stages" / "assign_rewards.py", *_SCHEMAS),
    "compute-advantages": source_version(ROOT / "stages" / "compute_advantages.py", *_SCHEMAS),
    "ppo-update": source_version(ROOT / "stages" / "ppo_update.py", *_SCHEMAS),
    POLICY: "1",
}


# ---------------------------------------------------------------------------------------
# Versions: what each stage hashes
# ---------------------------------------------------------------------------------------


def stage_config(config: RunConfig, stage: str, **position: int) -> dict[str, Any]:
    """The part of the run config a stage's output depends on (hashed into its version)."""
    if stage == "generate-rollouts":
        return {
            **config.section("generation", "task"),
            "seed": config.seed,
            "dtype": config.model.dtype,
            "device": pick_device(config.model.device).type,
            "environment_code": environment_code(config),
            **position,
        }
    if stage == "execute-tools":  # environments decide termination and observations
        return {**config.section("tools", "task", "generation"), "environment_code": environment_code(config)}
    if stage == "assign-rewards":  # and score the rollouts
        return {**config.section("reward"), "environment_code": environment_code(config)}
    if stage == "compute-advantages":
        return {
            **config.section("advantage"),
            "kl": {k: getattr(config.ppo, k) for k in ("kl_coef", "kl_estimator", "kl_in")},
            "temperature": config.generation.temperature,
            "device": pick_device(config.model.device).type,
        }
    if stage == "ppo-update":
        return {
            **config.section("ppo"),
            "seed": config.seed,
            "temperature": config.generation.temperature,
            "device": pick_device(config.model.device).type,
        }
    return {}


def stage_version(config: RunConfig, stage: str, parents: dict[str, str], **position: int) -> str:
    return version_key(stage, CODE_VERSIONS[stage], stage_config(config, stage, **position), parents)


# ---------------------------------------------------------------------------------------
# Runtime: the loaded policy (model, tokenizer, generation engine), one per process
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def cached_tokenizer(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


@functools.lru_cache(maxsize=1)
def _runtime(model_dir: str, dtype: str, device: str) -> tuple[Any, Any, generate_rollouts.Engine]:
    tokenizer = cached_tokenizer(model_dir)
    model = load_model(model_dir, dtype, device)
    engine = generate_rollouts.Engine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model))
    return model, tokenizer, engine


def policy_runtime(store: Store, config: RunConfig, policy_version: str) -> tuple[Any, Any, generate_rollouts.Engine]:
    return _runtime(str(store.policy_dir(policy_version)), config.model.dtype, config.model.device)


def import_base_policy(store: Store, config: RunConfig) -> str:
    """Register the starting model as policy version of iteration -1 (it is not copied)."""
    model_dir = resolve_model_dir(config.model.path)
    load_tokenizer(model_dir)  # fail early, before any work, if it has no chat template
    digests = file_digests(model_dir)
    version = version_key(POLICY, CODE_VERSIONS[POLICY], {"source_files": digests}, {})

    def fill(_tmp: Path) -> dict[str, Any]:
        return {"source_path": str(model_dir), "source_files": digests}

    store.write(POLICY, version, fill, {"parents": {}, "config": {}, "iteration": -1, "code_version": "1"})
    return version


def latest_policy(store: Store) -> str | None:
    """The newest policy of the store (the highest iteration, then the newest write)."""
    policies = store.versions(POLICY)
    if not policies:
        return None
    return max(policies, key=lambda m: (m.get("iteration", -1), m["created_at"]))["version"]


# ---------------------------------------------------------------------------------------
# Stage tasks
# ---------------------------------------------------------------------------------------


def write_stage(
    config: RunConfig,
    stage: str,
    version: str,
    parents: dict[str, str],
    compute: Callable[[], tuple[datasets.Dataset, dict[str, Any]]],
    **position: int,
) -> str:
    """Compute and atomically store a stage version, unless it is already on disk."""
    store = Store(config.store.runs_dir)
    if store.exists(stage, version):
        return version
    started = time.time()
    dataset, extra = compute()
    store.write_dataset(
        stage,
        version,
        dataset,
        {
            "parents": parents,
            "config": stage_config(config, stage, **position),
            "code_version": CODE_VERSIONS[stage],
            "tokens": token_counts(dataset),
            "wall_s": round(time.time() - started, 3),
            "process": {"host": socket.gethostname(), "pid": os.getpid()},  # where it ran (runner)
            **extra,
        },
    )
    get_run_logger().info("%s/%s: %d rows in %.1f s", stage, version, len(dataset), time.time() - started)
    publish_stage(store, stage, version)
    return version


def publish_stage(store: Store, stage: str, version: str) -> None:
    """A Prefect table artifact per stage version: rows, tokens, wall time and its metrics."""
    manifest = store.manifest(stage, version)
    table = {"version": version, "rows": manifest["rows"], "wall_s": manifest["wall_s"], **manifest.get("tokens", {})}
    for name, value in {**manifest.get("metrics", {}), **manifest.get("tool_failures", {})}.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            table[name] = round(value, 4) if isinstance(value, float) else value
    create_table_artifact(key=stage, table=[table], description=f"{stage}/{version} in {store.root}")


def stage_task(stage: str) -> Callable[[Callable[..., str]], Any]:
    """A Prefect task cached by the version it writes, with JSON (never pickle) results."""
    return task(
        name=stage,
        cache_key_fn=lambda context, parameters: f"{stage}/{parameters['version']}",
        result_serializer="json",
        persist_result=True,
    )


def run_stage(
    prefect_task: Any,
    config: RunConfig,
    parents: dict[str, str],
    position: dict[str, int] | None = None,
    runner: Any | None = None,
    **inputs: Any,
) -> str:
    """Run a stage task on these inputs (in this process, or on `runner` for the stages it
    takes); its version is known before it runs."""
    stage = prefect_task.name
    version = stage_version(config, stage, parents, **(position or {}))
    store = Store(config.store.runs_dir)
    configured = prefect_task.with_options(
        refresh_cache=not store.exists(stage, version),
        result_storage=store.root / ".prefect" / "results",
    )
    parameters = {"config": config, "version": version, "parents": parents, **(position or {}), **inputs}
    if runner is not None and stage in DISTRIBUTED_STAGES:
        return runner.submit(configured, parameters).result()
    return configured(**parameters)


def load_rounds(store: Store, tools_version: str) -> datasets.Dataset:
    return datasets.concatenate_datasets([store.load("execute-tools", v) for v in store.turns_of(tools_version)])


@stage_task("generate-rollouts")
def generate_rollouts_task(config: RunConfig, version: str, parents: dict[str, str], iteration: int, turn: int) -> str:
    store = Store(config.store.runs_dir)
    policy_version, previous = parents[POLICY], parents.get("execute-tools")

    def compute() -> tuple[datasets.Dataset, dict[str, Any]]:
        _, tokenizer, engine = policy_runtime(store, config, policy_version)
        history = load_rounds(store, previous) if previous else None
        dataset = generate_turn(
            engine, tokenizer, config, iteration=iteration, turn=turn, policy_version=policy_version, history=history
        )
        provenance = {
            "sampling": config.generation.model_dump(mode="json") | {"seed": config.seed},
            "logprob_convention": "log_softmax(logits / temperature) of the sampled token, before top-k/top-p",
            "context_convention": CONTEXT_CONVENTION,
            "chat_template_sha256": chat_template_hash(tokenizer),
        }
        # a cold engine (a resumed run) replays the earlier turns first; 0.0 means bit-identical
        return dataset, {"iteration": iteration, "turn": turn, "provenance": provenance, "replay": engine.last_replay}

    return write_stage(config, "generate-rollouts", version, parents, compute, iteration=iteration, turn=turn)


def execute_shard(turns: datasets.Dataset, model_dir: str, config: RunConfig) -> datasets.Dataset:
    """execute-tools on some of a turn's rows (all of them, or one Ray shard)."""
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet
    return execute_turn(turns, cached_tokenizer(model_dir), config)


@stage_task("execute-tools")
def execute_tools_task(config: RunConfig, version: str, parents: dict[str, str]) -> str:
    store = Store(config.store.runs_dir)
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet

    def compute() -> tuple[datasets.Dataset, dict[str, Any]]:
        turns = store.load("generate-rollouts", parents["generate-rollouts"])
        policy_version = store.manifest("generate-rollouts", parents["generate-rollouts"])["parents"][POLICY]
        dataset = map_row_shards(execute_shard, turns, config.runner, str(store.policy_dir(policy_version)), config)
        stops = dataset["stop_reason"]
        summary = {
            "active": sum(s is None for s in stops),
            "stop_reasons": {s: stops.count(s) for s in sorted(set(stops) - {None})},
            "tool_failures": execute_tools.failure_counts(dataset),
            "tools": sorted(execute_tools.TOOLS),
        }
        return dataset, {"turn": turns[0]["turn"] if len(turns) else None, **summary}

    return write_stage(config, "execute-tools", version, parents, compute)


@stage_task("assign-rewards")
def assign_rewards_task(config: RunConfig, version: str, parents: dict[str, str]) -> str:
    store = Store(config.store.runs_dir)
    load_plugins(config.task.plugins)  # a Ray worker has not imported them yet

    def compute() -> tuple[datasets.Dataset, dict[str, Any]]:
        turns = load_rounds(store, parents["execute-tools"])
        dataset = assign_rewards.assign_rewards(turns, assign_rewards.ENVIRONMENTS, config.reward)
        metrics = rollout_metrics(dataset, task_turn_limits(config))
        return dataset, {"metrics": metrics, "environment_code": environment_code(config)}

    return write_stage(config, "assign-rewards", version, parents, compute)


def reference_policy(store: Store, policy_version: str) -> str:
    """The starting policy of a lineage (iteration -1): the KL reference."""
    version = policy_version
    while parents := store.manifest(POLICY, version)["parents"]:
        version = store.manifest("ppo-update", parents["ppo-update"])["parents"][POLICY]
    return version


def advantage_parents(config: RunConfig, rewarded: str, policy_version: str, reference: str) -> dict[str, str]:
    """compute-advantages reads the policy (critic values) and the reference (KL) only if used."""
    parents = {"assign-rewards": rewarded}
    if config.advantage.estimator in compute_advantages.NEEDS_VALUES:
        parents[POLICY] = policy_version
    if config.ppo.kl_coef > 0:
        parents[f"{POLICY}#reference"] = reference
    return parents


def _scoring_model(store: Store, config: RunConfig, policy_version: str) -> tuple[Any, Any]:
    model_dir = store.policy_dir(policy_version)
    return load_model(model_dir, "float32", config.model.device), load_tokenizer(str(model_dir))


@stage_task("compute-advantages")
def compute_advantages_task(config: RunConfig, version: str, parents: dict[str, str]) -> str:
    store = Store(config.store.runs_dir)

    def compute() -> tuple[datasets.Dataset, dict[str, Any]]:
        turns = store.load("assign-rewards", parents["assign-rewards"])
        score = functools.partial(
            ppo_update.score_rollouts,
            temperature=config.generation.temperature,
            chunk_tokens=config.ppo.logprob_chunk_tokens,
            batch_rollouts=config.ppo.micro_batch_rollouts,
        )
        values = ref_logprobs = kl_penalty = None
        if POLICY in parents:  # the critic's values
            model, tokenizer = _scoring_model(store, config, parents[POLICY])
            head = ppo_update.ValueHead.load(store.policy_dir(parents[POLICY]), model.config.hidden_size)
            _, values = score(model, turns, pad_token_id=tokenizer.pad_token_id, value_head=head)
        if f"{POLICY}#reference" in parents:
            model, tokenizer = _scoring_model(store, config, parents[f"{POLICY}#reference"])
            ref_logprobs, _ = score(model, turns, pad_token_id=tokenizer.pad_token_id)
            if config.ppo.kl_in == "reward":
                kl_penalty = [
                    (
                        config.ppo.kl_coef
                        * ppo_update.kl_estimate(
                            torch.tensor(generated), torch.tensor(reference), config.ppo.kl_estimator
                        )
                    ).tolist()
                    for generated, reference in zip(turns["completion_logprobs"], ref_logprobs)
                ]
        dataset = compute_advantages.compute_advantages(
            turns, config.advantage, values=values, kl_penalty=kl_penalty, ref_logprobs=ref_logprobs
        )
        per_token = np.concatenate([np.asarray(a, dtype=np.float32) for a in dataset["advantages"]] or [np.zeros(0)])
        summary = {
            "advantage_mean": float(per_token.mean()) if per_token.size else 0.0,
            "advantage_abs_mean": float(np.abs(per_token).mean()) if per_token.size else 0.0,
        }
        return dataset, {"metrics": summary}

    return write_stage(config, "compute-advantages", version, parents, compute)


@stage_task("ppo-update")
def ppo_update_task(config: RunConfig, version: str, parents: dict[str, str], iteration: int) -> str:
    """Train the policy on the iteration's rollouts; write the next policy, then the metrics."""
    store = Store(config.store.runs_dir)
    advantaged, policy_version = parents["compute-advantages"], parents[POLICY]
    next_policy = version_key(POLICY, CODE_VERSIONS[POLICY], {}, {"ppo-update": version})

    def compute() -> tuple[datasets.Dataset, dict[str, Any]]:
        model, tokenizer = _scoring_model(store, config, policy_version)
        turns = store.load("compute-advantages", advantaged)
        report = audit(
            turns,
            store,
            tokenizer,
            enable_thinking=config.generation.enable_thinking,
            rescore_fraction=config.ppo.audit_rescore_fraction,
            rescore_tolerance=config.ppo.audit_tolerance,
            temperature=config.generation.temperature,
            seed=config.seed + iteration,
        )
        if not report.ok:
            raise AuditError(f"compute-advantages/{advantaged} fails the audit: " + "; ".join(report.problems))
        value_head = None
        if config.advantage.estimator in compute_advantages.NEEDS_VALUES:
            value_head = ppo_update.ValueHead.load(store.policy_dir(policy_version), model.config.hidden_size)
            value_head.to(model.device)
        optimizer, restored = None, 0
        if config.ppo.lora_rank > 0:  # fresh adapters, merged after the update: no optimiser to continue
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.ppo.lora_rank, lora_alpha=config.ppo.lora_alpha, target_modules="all-linear")
            model = get_peft_model(model, lora)
        else:  # continue the AdamW of the previous iteration (its state is saved beside its policy)
            optimizer = ppo_update.build_optimizer(model, config.ppo, value_head)
            restored = ppo_update.load_optimizer_state(optimizer, model, value_head, store.policy_dir(policy_version))
        with peak_memory() as memory:  # this stage's own peak (resident set; CUDA allocator)
            metrics = ppo_update.ppo_update(
                model,
                turns,
                config=config.ppo,
                temperature=config.generation.temperature,
                pad_token_id=tokenizer.pad_token_id,
                seed=config.seed + iteration,
                value_head=value_head,
                optimizer=optimizer,
            )
        if config.ppo.lora_rank > 0:
            model = model.merge_and_unload()  # the next policy is a plain checkpoint

        def save(tmp: Path) -> dict[str, Any]:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if value_head is not None:
                value_head.save(tmp)
            if optimizer is not None:
                ppo_update.save_optimizer_state(optimizer, model, value_head, tmp)
            return {}

        store.write(
            POLICY,
            next_policy,
            save,
            {
                "parents": {"ppo-update": version},
                "config": {},
                "code_version": CODE_VERSIONS[POLICY],
                "iteration": iteration,
            },
        )
        dataset = dataset_from_rows(metrics, PPO_UPDATE)
        return dataset, {
            "metrics": ppo_update.metrics_summary(metrics),
            "audit": report.as_dict(),
            "memory": memory,
            "optimizer_state_restored": restored,  # parameters whose AdamW state continued (0: fresh)
            "policy": next_policy,
            "iteration": iteration,
        }

    write_stage(config, "ppo-update", version, parents, compute)
    return next_policy


# ---------------------------------------------------------------------------------------
# Flows
# ---------------------------------------------------------------------------------------


@flow(name="rl-iteration")
def rl_iteration(config: RunConfig, iteration: int | None = None, policy_version: str | None = None) -> dict[str, Any]:
    """One RL iteration. Without arguments: the next iteration from the store's newest policy
    (what a scheduled deployment run does). One iteration at a time per store: a file lock."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock(), stage_runner(config.runner) as runner:
        store.clean_stale_tmp()
        if policy_version is None:
            policy_version = latest_policy(store) or import_base_policy(store, config)
        if iteration is None:
            iteration = store.manifest(POLICY, policy_version).get("iteration", -1) + 1

        previous: str | None = None  # the execute-tools version of the last turn
        for turn in range(turn_limit(config)):
            generated = run_stage(
                generate_rollouts_task,
                config,
                {POLICY: policy_version, **({"execute-tools": previous} if previous else {})},
                position={"iteration": iteration, "turn": turn},
            )
            previous = run_stage(execute_tools_task, config, {"generate-rollouts": generated}, runner=runner)
            if store.manifest("execute-tools", previous)["active"] == 0:
                break
        rewarded = run_stage(assign_rewards_task, config, {"execute-tools": previous}, runner=runner)
        reference = reference_policy(store, policy_version)
        advantaged = run_stage(
            compute_advantages_task, config, advantage_parents(config, rewarded, policy_version, reference)
        )
        next_policy = run_stage(
            ppo_update_task, config, {"compute-advantages": advantaged, POLICY: policy_version}, iteration=iteration
        )
    metrics = store.manifest("assign-rewards", rewarded)["metrics"]
    get_run_logger().info(
        "iteration %d: reward %.3f, success %.2f", iteration, metrics["reward_mean"] or 0, metrics["success_rate"] or 0
    )
    publish_summary(store, next_policy)
    return {
        "iteration": iteration,
        "policy": policy_version,
        "next_policy": next_policy,
        "versions": {
            "execute-tools": store.turns_of(previous),
            "assign-rewards": rewarded,
            "compute-advantages": advantaged,
            "ppo-update": store.manifest(POLICY, next_policy)["parents"]["ppo-update"],
        },
        "metrics": metrics,
    }


@flow(name="rl-training")
def rl_training(config: RunConfig) -> list[dict[str, Any]]:
    """config.iterations RL iterations from the starting model, each one an rl-iteration run."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock():
        policy_version = import_base_policy(store, config)
    results = []
    with stage_runner(config.runner):  # one Ray for all iterations (each iteration reuses it)
        for iteration in range(config.iterations):
            results.append(rl_iteration(config, iteration=iteration, policy_version=policy_version))
            policy_version = results[-1]["next_policy"]
    return results


RERUNNABLE = ("assign-rewards", "compute-advantages", "ppo-update")


def lineage_config(store: Store, stage: str, version: str) -> dict[str, Any]:
    """The config sections recorded in a version's ancestors (the newest record of each wins)."""
    sections: dict[str, Any] = {}
    for manifest in reversed(store.lineage(stage, version)):
        config = manifest.get("config", {})
        for name in ("generation", "task", "tools", "reward", "advantage", "ppo"):
            if isinstance(config.get(name), dict):
                sections[name] = config[name]
        if "seed" in config:
            sections["seed"] = config["seed"]
    return sections


def generating_policy(store: Store, stage: str, version: str) -> str:
    """The policy that generated the rollouts a version was computed from."""
    rows = next(m for m in store.lineage(stage, version) if m["stage"] == "generate-rollouts")
    return rows["parents"][POLICY]


@flow(name="rl-stage")
def rerun_stage(config: RunConfig, stage: str, source: str) -> str:
    """Re-run one stage on a stored input (e.g. re-score rewards, or A/B two estimators on the
    same rollouts); writes a new version beside the old one, or finds it already stored."""
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    source_stage, source_version = store.resolve(source)
    expected = {
        "assign-rewards": "execute-tools",
        "compute-advantages": "assign-rewards",
        "ppo-update": "compute-advantages",
    }
    if stage not in expected or source_stage != expected[stage]:
        raise ValueError(
            f"`mtrl stage {stage}` runs on {expected.get(stage, '?')}/VERSION; stages: {', '.join(RERUNNABLE)}"
        )
    policy = generating_policy(store, source_stage, source_version)
    with store.lock(), stage_runner(config.runner) as runner:
        if stage == "assign-rewards":
            return run_stage(assign_rewards_task, config, {"execute-tools": source_version}, runner=runner)
        if stage == "compute-advantages":
            parents = advantage_parents(config, source_version, policy, reference_policy(store, policy))
            return run_stage(compute_advantages_task, config, parents)
        iteration = next(m for m in store.lineage(source_stage, source_version) if m["stage"] == "generate-rollouts")
        next_policy = run_stage(
            ppo_update_task,
            config,
            {"compute-advantages": source_version, POLICY: policy},
            iteration=iteration["iteration"],
        )
        return store.manifest(POLICY, next_policy)["parents"]["ppo-update"]


def publish_summary(store: Store, policy_version: str) -> None:
    """The learning curve so far, as a Prefect markdown artifact and a PNG in the runs dir."""
    curve, png = write_report(store, policy_version=policy_version)
    create_markdown_artifact(
        key="rl-iteration-summary",
        markdown=f"## mtrl learning curve\n\n```\n{curve}\n```\n\nPlot: `{png}`\n\nStore: `{store.root}`",
        description="success, reward, turns and training metrics per iteration",
    )
