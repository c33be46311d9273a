"""ppo-update: train the policy on an iteration's rollouts with the clipped PPO objective and write
the next policy (the update itself: train.py; its process on several ranks: worker.py).

run() decides what the update computes beside its settings: the old logprobs of the ratio (the
stale-rollouts rule), the memory settings by the model's size (stages/policy/batching.py), and
whether the critic learns (the rollouts carry its values); then it trains in this process or on
ppo.world_size processes (runtime/launch.py starts them under torchrun, here or on Ray nodes; each
runs worker.py, which calls train.train_policy).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.launch import Placement, run_on_ranks
from runtime.memory import peak_memory
from runtime.passes import PassCounts, add_counts, counting_passes
from runtime.phases import PHASES
from schemas.features import PPO_UPDATE, dataset_from_rows
from schemas.stage import POLICY, Inputs, Output, Stage
from stages.policy.batching import training_memory
from stages.policy.loading import exact_generation_logprobs, parameter_count
from stages.ppo_update import worker
from stages.ppo_update.train import (
    PPOSettings,
    aggregate,
    build_optimizer,
    metrics_summary,
    optimise_policy,
    policy_loss,
    token_loss,
    train_policy,
    truncated_is_weight,
    value_loss,
)

LOG = logging.getLogger("mtrl.ppo_update")


def old_logprobs_recomputed(settings: PPOSettings, stale: bool) -> bool:
    """Do the clipped ratio's old logprobs come from a forward pass of the trained policy? The
    policy before the update generated the rollouts, so its old logprobs are the generation
    logprobs whenever the generation forward is the training forward: the exact hf engine in
    float32 (unless ppo.recompute_old_logprobs says otherwise). Rollouts of an older policy than
    the one trained (ppo.max_staleness) are the decoupled case: the ratio is taken against the
    trained policy's recomputed logprobs, the TIS weight corrects from the generating one."""
    if stale and settings.recompute_old_logprobs is False:
        raise ValueError(
            "ppo-update of a newer policy than the one that generated the rollouts needs the trained policy's own "
            "old logprobs: leave ppo.recompute_old_logprobs null"
        )
    if stale:
        return True
    if settings.recompute_old_logprobs is not None:
        return settings.recompute_old_logprobs
    return not exact_generation_logprobs(settings.generation_engine, settings.generation_dtype)


def train_on_ranks(
    inputs: Inputs,
    settings: PPOSettings,
    policy_dir: Path,
    train_critic: bool,
    seed: int,
    report_progress: Callable[[float], None] | None,
) -> tuple[TrainedOnRanks, dict[str, Any], PassCounts, dict[str, Any]]:
    """train_policy on settings.world_size processes (runtime/launch.py: torchrun here, or on
    settings.nodes Ray nodes), each one a worker.py; returns what rank 0 wrote, the memory of the
    largest rank (then each rank's), every rank's passes and where the ranks ran."""
    work = inputs.scratch()
    request = worker.write_request(
        work,
        turns_dir=inputs.folder("compute-advantages"),
        policy_dir=policy_dir,
        settings=settings,
        train_critic=train_critic,
        seed=seed,
    )
    placement = Placement(settings.world_size, settings.nodes, settings.ray_address, settings.requested_device)
    nodes = run_on_ranks(worker.MODULE, request, placement, LOG.info, report_progress)
    trained = TrainedOnRanks(work / worker.POLICY_FILES, **json.loads((work / worker.RESULT).read_text()))
    ranks = trained.memory_per_rank
    passes: PassCounts = {}
    for rank in ranks:  # each rank's passes over its share
        add_counts(passes, rank.pop("passes"))
    # the largest rank's peak, as one process reports its own; then each rank's
    memory = {name: max(rank[name] for rank in ranks) for name in ("rss_before_mb", "peak_rss_mb")}
    return trained, {**memory, "ranks": ranks, "scope": "the largest rank"}, passes, {"nodes": nodes}


@dataclass
class TrainedOnRanks:
    """What rank 0 of a job on several processes wrote: the next policy's files and the metrics."""

    files: Path
    metrics: list[dict[str, float]]
    optimizer_state_restored: int
    memory_per_rank: list[dict[str, Any]]
    train_s: float  # train_policy's wall time on rank 0 (without the processes' start-up)

    def save(self, directory: Path) -> dict[str, Any]:
        """Move the files into the store's temporary folder (same filesystem: a rename)."""
        for path in sorted(self.files.iterdir()):
            shutil.move(path, directory / path.name)
        return {}


AHEAD_THREAD = "experience-ahead"  # the flow's thread that makes the next batch beside an update


def run(inputs: Inputs, settings: PPOSettings, report_progress: Callable[[float], None] | None = None) -> Output:
    """ppo-update of the policy (input "policy": the one that generated the rollouts, or with
    ppo.max_staleness a newer one) on a compute-advantages version, in this process or on
    ppo.world_size processes; the next policy is written with its metrics."""
    turns = inputs.load("compute-advantages")
    rollouts_iteration = inputs.manifest("compute-advantages").iteration
    generating = inputs.generating_policy("compute-advantages")
    stale = generating.version != inputs.parents[POLICY]
    policy_dir = inputs.folder(POLICY)  # its files checked once, here
    settings = settings.model_copy(update={"recompute_old_logprobs": old_logprobs_recomputed(settings, stale)})
    settings = training_memory(settings, policy_dir, settings.device)
    train_critic = any(turns["values"])  # the estimator read the critic: it learns with the policy
    seed = settings.seed + rollouts_iteration
    # the resident set is the process's: with ppo.max_staleness the next batch, made in a thread beside
    # this one, counts too (memory.scope says so; torchrun's ranks measure only themselves)
    beside = any(thread.name.startswith(AHEAD_THREAD) for thread in threading.enumerate())
    placement: dict[str, Any] = {}
    with peak_memory() as memory, counting_passes() as passes, PHASES.span("stage_compute"):
        if settings.world_size == 1:
            trained = train_policy(
                turns, policy_dir, settings, train_critic=train_critic, seed=seed, report_progress=report_progress
            )
        else:
            trained, ranks_memory, rank_passes, placement = train_on_ranks(
                inputs, settings, policy_dir, train_critic, seed, report_progress
            )
            add_counts(passes, rank_passes)
    if settings.world_size == 1:
        memory["scope"] = "the process, with the next batch made beside it" if beside else "this stage"
    else:  # the ranks' memory, not this process's (which only waited for them)
        memory = ranks_memory
    fields = {
        "metrics": metrics_summary(trained.metrics),
        "memory": memory,
        # what gradient_checkpointing / max_tokens_per_micro_batch were (null: chosen by the model's size)
        "memory_settings": {
            "parameters": parameter_count(policy_dir),
            **settings.model_dump(include={"gradient_checkpointing", "max_tokens_per_micro_batch"}),
        },
        "optimizer_state_restored": trained.optimizer_state_restored,
        "old_logprobs": "recomputed" if settings.recompute_old_logprobs else "generation",
        # every pass over the policy, by kind, with its tokens (all ranks'; the audit's re-score is in
        # "audit"); a pass a setting does not need is absent (old logprobs when the generation ones are
        # exact, the recomputed forward without activation checkpointing)
        "passes": passes,
        "staleness": inputs.manifest(POLICY).iteration - generating.iteration,
        **placement,
    }
    return Output(dataset_from_rows(trained.metrics, PPO_UPDATE), fields, save_policy=trained.save)


STAGE = Stage(
    name="ppo-update",
    inputs=("compute-advantages", POLICY),
    features=PPO_UPDATE,
    settings=PPOSettings,
    run=run,
    rerun_from="compute-advantages",
    writes_policy=True,
    audits="compute-advantages",
    continues_optimizer=lambda settings: settings.lora_rank == 0,
)


__all__ = [  # the update's parts, for a user of the stage (tests, benchmarks)
    "PPOSettings",
    "aggregate",
    "build_optimizer",
    "optimise_policy",
    "policy_loss",
    "token_loss",
    "train_policy",
    "truncated_is_weight",
    "value_loss",
]
