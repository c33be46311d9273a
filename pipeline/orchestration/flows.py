"""Prefect flows of mtrl. They read like the data flow of one iteration (docs/architecture.md):

    policy vN ─┐
    tasks ─────┴─> [generate-rollouts]_t ─> [execute-tools]_t   for t = 0..T-1 (active rollouts)
                                         └─> [assign-rewards] ─> [compute-advantages] ─> [ppo-update] ─> policy vN+1

Each stage runs as a Prefect task (pipeline/orchestration/stage_runs.py) that writes one version of its dataset;
the flows pass versions, and the store on disk holds the data.

With ppo.max_staleness K > 0 the rollouts of iteration i come from policy max(0, i - K), and
iteration i + 1's experience (rollouts, rewards, advantages: it needs no newer policy) is made
while iteration i trains:

    rl-iteration i:  [experience i] ─> [ppo-update i] ─> policy vi+1
                                   └─> [experience i+1, by policy max(0, i+1-K)]   (at the same time)
"""

import contextvars
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger

from pipeline.models.base_model import import_base_policy
from pipeline.monitoring import artifacts, tracking
from pipeline.monitoring.artifacts import generation_progress, publish_summary
from pipeline.orchestration.preflight import check_config
from pipeline.orchestration.runners import stage_runner
from pipeline.orchestration.stage_runs import open_engine, run_stage, settings_of
from pipeline.orchestration.stage_table import POLICY, STAGES, rerun_map
from pipeline.prefect_plumbing.settings import flow_heartbeats
from pipeline.store import lineage, retention
from pipeline.store.versions import Store
from runtime.interrupt import INTERRUPTED
from runtime.phases import PHASES
from runtime.threads import use_threads
from schemas.config import RunConfig
from stages.generate_rollouts.engine import ENGINE
from stages.ppo_update import AHEAD_THREAD


@dataclass(frozen=True)
class Experience:
    """What an iteration makes before ppo-update, which reads only the generating policy (and the
    reference): its store versions and its rollouts' metrics."""

    iteration: int
    policy: str  # the generating policy
    turns: list[str]  # the execute-tools version of each turn
    rewarded: str  # assign-rewards
    advantaged: str  # compute-advantages: the batch ppo-update trains on
    metrics: dict[str, Any]  # the rollouts' (assign-rewards)


def flow_start(config: RunConfig) -> Store:
    """What every flow does first (a deployment's run starts here, not in `mtrl`): this process's
    thread count, the pre-flight checks (they import the task plugins too), the store."""
    use_threads(config.runner.threads, overlapping=config.stages_overlap())
    check_config(config)
    return Store(config.store.runs_dir)


def starting_policy(store: Store, config: RunConfig) -> str:
    """The policy RL starts from (and the KL reference): the imported model, or with sft.steps > 0
    its warm start (a stored version: the same settings on the same model train once)."""
    base = import_base_policy(store, config)
    if config.sft.steps == 0:
        return base
    return run_stage(config, "sft", {POLICY: base}).policy


@flow(name="rl-iteration")
@artifacts.sent_before_exit
def rl_iteration(
    config: RunConfig,
    iteration: int | None = None,
    policy_version: str | None = None,
    plot: bool = True,
    generate_next: bool = True,
    batch: Experience | None = None,
) -> dict[str, Any]:
    """One RL iteration: train `policy_version` on rollouts of the policy ppo.max_staleness updates
    before it. Without arguments: the next iteration from the store's newest policy (what a
    scheduled deployment run does). One iteration at a time per store: a file lock.
    `plot`: draw the learning curve into the summary artifact (rl-training: at its last iteration).
    `generate_next` (with max_staleness > 0): make the next iteration's experience while this one
    trains; the next run is passed it as `batch` (rl-training) or finds it stored (a deployment's
    next run). rl-training's last iteration passes False."""
    store = flow_start(config)
    staleness = config.ppo.max_staleness
    with store.lock(), stage_runner(config.runner) as runner, PHASES.section("iteration"):
        policy_version = policy_version or lineage.latest_policy(store) or starting_policy(store, config)
        iteration = store.manifest(POLICY, policy_version).iteration + 1 if iteration is None else iteration
        generating = lineage.policies_before(store, policy_version, staleness)
        batch = batch or experience(config, iteration, generating[staleness], runner)
        ahead: AbstractContextManager[Future | None] = nullcontext()
        if generate_next and staleness > 0:  # its policy, one update less behind, is in the store already
            ahead = made_beside(config, iteration + 1, generating[staleness - 1], runner)
        with ahead as next_batch:  # the update and its bookkeeping; the next batch is made beside them
            parents = {"compute-advantages": batch.advantaged, POLICY: policy_version}
            updated = run_stage(config, "ppo-update", parents)  # its task audits the batch first
            retention.prune_lineage(store, config.store.keep_optimizer_state, updated.policy)
            get_run_logger().info(
                "iteration %d: reward %.3f, success %.2f",
                iteration,
                batch.metrics["reward_mean"] or 0,
                batch.metrics["success_rate"] or 0,
            )
            made_by_iteration = lineage.iteration_versions(store, updated.policy)  # the run so far, read once
            publish_summary(store, made_by_iteration, plot=plot)
            tracking.log_iteration(config, store, made_by_iteration)  # copied to tracking.backends
    return {
        "iteration": iteration,
        "policy": policy_version,
        "generating_policy": batch.policy,
        "next_policy": updated.policy,
        "versions": {
            "execute-tools": batch.turns,
            "assign-rewards": batch.rewarded,
            "compute-advantages": batch.advantaged,
            "ppo-update": updated.version,
        },
        "metrics": batch.metrics,
        "next_batch": made_ahead(next_batch),
    }


def experience(
    config: RunConfig, iteration: int, policy: str, runner: Any, stop: threading.Event | None = None
) -> Experience:
    """Everything of an iteration before ppo-update: its rollouts turn by turn (generate-rollouts,
    then execute-tools, until no rollout is active or the turn limit), their rewards and
    advantages (stored versions are found at once); ppo-update audits the batch before it trains.
    `stop` (set when the thread beside this one failed or was interrupted) ends it at the next turn
    or stage boundary."""

    def check_stop() -> None:
        if INTERRUPTED.is_set():  # a Ctrl-C, even one Prefect swallowed (runtime/interrupt.py)
            raise KeyboardInterrupt
        if stop is not None and stop.is_set():
            raise StoppedError(f"iteration {iteration}'s experience stopped: the thread beside it failed")

    turn_limit = settings_of("generate-rollouts", config).turn_limit()
    progress = generation_progress(iteration, turn_limit)
    turns: list[str] = []  # the execute-tools version of each turn
    for turn in range(turn_limit):
        check_stop()
        with PHASES.section("turn"):  # where a turn's time goes (bench/long_episodes.py)
            previous = {"execute-tools": turns[-1]} if turns else {}
            generated = run_stage(
                config,
                "generate-rollouts",
                {POLICY: policy, **previous},
                {"iteration": iteration, "turn": turn},
                progress=artifacts.turn_stretch(progress, iteration, turn, turn_limit),
            )
            executed = run_stage(config, "execute-tools", {"generate-rollouts": generated.version}, runner=runner)
            turns.append(executed.version)
            if executed.active == 0:
                break
    progress.finish(f"iteration {iteration}: all rollouts stopped after {len(turns)} turn(s)")
    ENGINE.close(unless_it_reloads=True)  # free its memory for the stages that load models
    check_stop()
    rewarded = run_stage(config, "assign-rewards", {"execute-tools": turns[-1]}, runner=runner)
    check_stop()
    advantaged = run_stage(config, "compute-advantages", {"assign-rewards": rewarded.version}).version
    return Experience(iteration, policy, turns, rewarded.version, advantaged, rewarded.metrics)


class StoppedError(Exception):
    """The work of one thread of an overlapped iteration, ended because the other one failed."""


@contextmanager
def made_beside(config: RunConfig, iteration: int, policy: str, runner: Any) -> Iterator[Future]:
    """Iteration `iteration`'s experience, made in a thread while the block runs, inside this flow run
    (its task runs are this run's, shown running beside the block's), and waited for at the block's end;
    yields its future. Its engine is opened (or updated and verified) here, in the flow's thread, before
    the thread starts: the hf engine loads its model in model.dtype, and a load sets the process's
    default dtype, which must not change while ppo-update's forward passes run beside it. The block's own
    error (Ctrl-C included) sets the thread's `stop` and is raised once it has stopped at its next
    boundary."""
    open_engine(config, policy)
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=AHEAD_THREAD) as pool:
        done = pool.submit(contextvars.copy_context().run, experience, config, iteration, policy, runner, stop)
        try:
            yield done
            wait([done])  # a Ctrl-C while waiting lands in the except below
        except BaseException:
            stop.set()
            wait([done])
            raise


def made_ahead(made: Future | None) -> Experience | None:
    """The experience made beside an update, or None (none was made, or it failed: a warning says
    so, and the next iteration makes it again, finding what the store holds, and fails as itself
    if the error is still there)."""
    if made is None:
        return None
    failure = made.exception()
    if failure is None:
        return made.result()
    if isinstance(failure, KeyboardInterrupt):
        raise failure
    get_run_logger().warning("the next iteration's experience, made beside this update, failed (%s)", failure)
    return None


@flow(name="rl-training")
@artifacts.sent_before_exit
def rl_training(config: RunConfig) -> list[dict[str, Any]]:
    """config.iterations RL iterations from the starting model (warm-started first when
    sft.steps > 0), each one an rl-iteration run."""
    store = flow_start(config)
    with store.lock():
        policy_version = starting_policy(store, config)
    results: list[dict[str, Any]] = []
    batch = None  # the next iteration's experience, when it was made beside an update
    # one Ray for all iterations (each iteration reuses it); the iterations run in this
    # process, so this run's heartbeat covers them (prefect_settings.flow_heartbeats)
    with stage_runner(config.runner), flow_heartbeats(enabled=False):
        try:
            for iteration in range(config.iterations):
                if INTERRUPTED.is_set():
                    raise KeyboardInterrupt
                last = iteration == config.iterations - 1
                result = rl_iteration(config, iteration, policy_version, plot=last, generate_next=not last, batch=batch)
                batch, policy_version = result.pop("next_batch"), result["next_policy"]
                results.append(result)
        finally:
            ENGINE.close()
    return results


@flow(name="sft")
@artifacts.sent_before_exit
def warm_start(config: RunConfig) -> str:
    """Import the starting model and fine-tune it on demonstrations (sft.steps steps, a stored
    version: found, not trained again, when it exists); returns the policy version RL starts
    from with the same config."""
    store = flow_start(config)
    with store.lock():
        return starting_policy(store, config)


@flow(name="rl-stage")
@artifacts.sent_before_exit
def rerun_stage(config: RunConfig, stage: str, source: str, policy: str | None = None) -> str:
    """Re-run one stage on a stored input (e.g. re-score rewards, or A/B two estimators on the
    same rollouts); writes a new version beside the old one, or finds it already stored.
    `policy`: the policy ppo-update trains (default: the rollouts' generating policy)."""
    store = flow_start(config)
    source_stage, source_version = store.resolve(source)
    if rerun_map().get(stage) != source_stage:
        choices = ", ".join(f"{name} --from {source}/VERSION" for name, source in rerun_map().items())
        raise ValueError(f"`mtrl stage {stage}` cannot run on {source_stage}/VERSION; valid: {choices}")
    if policy is not None and stage != "ppo-update":
        raise ValueError(f"{stage} reads the policy of its rollouts' lineage; only ppo-update takes a policy")
    with store.lock(), stage_runner(config.runner) as runner:
        trains = {POLICY: policy} if policy else {}
        made = run_stage(config, stage, {source_stage: source_version, **trains}, runner=runner)
        if STAGES[stage].writes_policy:
            retention.prune_lineage(store, config.store.keep_optimizer_state, made.policy)
        return made.version
