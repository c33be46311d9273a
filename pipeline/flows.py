"""Prefect flows of mtrl. They read like the data flow of one iteration (docs/architecture.md):

    policy vN ─┐
    tasks ─────┴─> [generate-rollouts]_t ─> [execute-tools]_t   for t = 0..T-1 (active rollouts)
                                         └─> [assign-rewards] ─> [compute-advantages] ─> [ppo-update] ─> policy vN+1

Each stage is a Prefect task (pipeline/tasks.py) that writes one version of its dataset; the
flows pass versions, and the store on disk holds the data.

With ppo.max_staleness K > 0 the rollouts of iteration i come from policy max(0, i - K), and
iteration i + 1's experience (rollouts, rewards, advantages: it needs no newer policy) is made
while iteration i trains:

    rl-iteration i:  [experience i] ─> [ppo-update i] ─> policy vi+1
                                   └─> [experience i+1, by policy max(0, i+1-K)]   (at the same time)
"""

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import Any

from prefect import flow, get_run_logger

from pipeline import artifacts, lineage, retention
from pipeline.artifacts import generation_progress, publish_summary
from pipeline.audit import audit_before_training
from pipeline.prefect_settings import flow_heartbeats
from pipeline.runners import stage_runner
from pipeline.stage_table import POLICY, STAGES
from pipeline.store import Store
from pipeline.tasks import (
    AHEAD_THREAD,
    POLICY_ENGINE,
    execute_tools_task,
    generate_rollouts_task,
    run_on,
    run_stage,
    starting_policy,
)
from runtime.interrupt import INTERRUPTED
from runtime.phases import PHASES
from runtime.threads import use_threads
from schemas.config import RunConfig
from stages.task_mix import load_plugins, turn_limit


@flow(name="rl-iteration")
@artifacts.sent_before_exit
def rl_iteration(
    config: RunConfig,
    iteration: int | None = None,
    policy_version: str | None = None,
    plot: bool = True,
    generate_next: bool = True,
) -> dict[str, Any]:
    """One RL iteration: train `policy_version` on rollouts of the policy ppo.max_staleness updates
    before it. Without arguments: the next iteration from the store's newest policy (what a
    scheduled deployment run does). One iteration at a time per store: a file lock.
    `plot`: draw the learning curve into the summary artifact (rl-training: at its last iteration).
    `generate_next` (with max_staleness > 0): make the next iteration's experience (rollouts,
    rewards, advantages) while this one trains; its run (the next in rl-training, or a
    deployment's next run) finds them stored. rl-training's last iteration passes False."""
    use_threads(config.runner.threads)  # a deployment's run starts here, not in `mtrl`
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    staleness = config.ppo.max_staleness
    with store.lock(), stage_runner(config.runner) as runner, PHASES.section("iteration"):
        store.clean_stale_tmp()
        if policy_version is None:
            policy_version = lineage.latest_policy(store) or starting_policy(store, config)
        if iteration is None:
            iteration = store.manifest(POLICY, policy_version).iteration + 1

        generating = lineage.policy_before(store, policy_version, staleness)
        advantaged = experience(config, iteration, generating, runner)
        ahead = nullcontext()
        if generate_next and staleness > 0:  # its policy, one update less behind, is in the store already
            next_generating = lineage.policy_before(store, policy_version, staleness - 1)
            # The engine is opened or updated (and verified) here, before the thread starts: the hf
            # engine loads its model in model.dtype, and a load sets the process's default dtype
            # while ppo-update's forward passes would run beside it (stages/policy.py: TRANSFORMERS_GLOBALS).
            POLICY_ENGINE.serving(store, config, next_generating)
            ahead = in_background(experience, config, iteration + 1, next_generating, runner)
        try:
            with ahead:  # the update and its bookkeeping; the next batch is made beside them
                updated = run_on("ppo-update", config, advantaged, policy=policy_version)
                next_policy = store.manifest("ppo-update", updated).policy
                prune_lineage(store, config, next_policy)
                rewarded = store.manifest("compute-advantages", advantaged).parents["assign-rewards"]
                metrics = store.manifest("assign-rewards", rewarded).metrics
                get_run_logger().info(
                    "iteration %d: reward %.3f, success %.2f",
                    iteration,
                    metrics["reward_mean"] or 0,
                    metrics["success_rate"] or 0,
                )
                publish_summary(store, next_policy, plot=plot)
        except BackgroundError as failure:
            # Not this iteration's failure: the next one makes its experience again (finding what
            # the store holds) and fails as itself if the error is still there.
            get_run_logger().warning(
                "iteration %d's experience, made beside this update, failed (%s); iteration %d makes it again",
                iteration + 1,
                failure.__cause__,
                iteration + 1,
            )
        last_turn = store.manifest("assign-rewards", rewarded).parents["execute-tools"]
    return {
        "iteration": iteration,
        "policy": policy_version,
        "generating_policy": generating,
        "next_policy": next_policy,
        "versions": {
            "execute-tools": lineage.turns_of(store, last_turn),
            "assign-rewards": rewarded,
            "compute-advantages": advantaged,
            "ppo-update": updated,
        },
        "metrics": metrics,
    }


def experience(
    config: RunConfig, iteration: int, policy_version: str, runner: Any, stop: threading.Event | None = None
) -> str:
    """Everything of an iteration before ppo-update, which reads only the generating policy (and
    the reference): its rollouts turn by turn (generate-rollouts, then execute-tools, until no
    rollout is active), their rewards and advantages, and the audit. Returns the
    compute-advantages version (stored ones are found at once). `stop` (set when the thread
    beside this one failed or was interrupted) ends it at the next turn or stage boundary."""

    def check_stop() -> None:
        if INTERRUPTED.is_set():  # a Ctrl-C, even one Prefect swallowed (runtime/interrupt.py)
            raise KeyboardInterrupt
        if stop is not None and stop.is_set():
            raise StoppedError(f"iteration {iteration}'s experience stopped: the thread beside it failed")

    store = Store(config.store.runs_dir)
    last_turn: str | None = None  # the execute-tools version of the latest turn
    progress = generation_progress(iteration, turn_limit(config))
    for turn in range(turn_limit(config)):
        check_stop()
        generated = run_stage(
            generate_rollouts_task,
            config,
            {POLICY: policy_version, **({"execute-tools": last_turn} if last_turn else {})},
            position={"iteration": iteration, "turn": turn},
            progress_artifact=progress.artifact_id,
        )
        last_turn = run_stage(execute_tools_task, config, {"generate-rollouts": generated}, runner=runner)
        if store.manifest("execute-tools", last_turn).active == 0:
            break
    progress.finish(f"iteration {iteration}: all rollouts stopped after {turn + 1} turn(s)")
    POLICY_ENGINE.close(unless_it_reloads=True)  # free its memory for the stages that load models
    check_stop()
    rewarded = run_on("assign-rewards", config, last_turn, runner)
    check_stop()
    advantaged = run_on("compute-advantages", config, rewarded)
    check_stop()
    # ppo-update's gate, passed as soon as the batch exists (its task finds the pass): with
    # ppo.max_staleness, beside the previous update; a batch that fails is never trained on
    audit_before_training(store, advantaged, config, seed=config.seed + iteration)
    return advantaged


class StoppedError(Exception):
    """The work of one thread of an overlapped iteration, ended because the other one failed."""


class BackgroundError(Exception):
    """What the work made in the background raised (its __cause__), once the block beside it ended well."""


@contextmanager
def in_background(function: Callable[..., Any], *args: Any) -> Iterator[None]:
    """Run function(*args, stop) in a thread while the block runs, inside this flow run (its task
    runs are this run's, shown running beside the block's), and wait for it at the block's end.
    The block's own error (Ctrl-C included) sets `stop` and is raised once the thread has stopped
    at its next boundary; the thread's error is raised at the block's end as a BackgroundError."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=AHEAD_THREAD) as pool:
        done = pool.submit(contextvars.copy_context().run, function, *args, stop)
        try:
            yield
            wait([done])  # a Ctrl-C while waiting lands in the except below
        except BaseException:
            stop.set()
            wait([done])
            raise
        if done.exception() is not None:
            raise BackgroundError(f"{function.__name__} in the background failed") from done.exception()


@flow(name="rl-training")
@artifacts.sent_before_exit
def rl_training(config: RunConfig) -> list[dict[str, Any]]:
    """config.iterations RL iterations from the starting model (warm-started first when
    sft.steps > 0), each one an rl-iteration run."""
    use_threads(config.runner.threads)  # a deployment's run starts here, not in `mtrl`
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock():
        policy_version = starting_policy(store, config)
    results = []
    # one Ray for all iterations (each iteration reuses it); the iterations run in this
    # process, so this run's heartbeat covers them (prefect_settings.flow_heartbeats)
    with stage_runner(config.runner), flow_heartbeats(enabled=False):
        try:
            for iteration in range(config.iterations):
                if INTERRUPTED.is_set():
                    raise KeyboardInterrupt
                last = iteration == config.iterations - 1
                results.append(rl_iteration(config, iteration, policy_version, plot=last, generate_next=not last))
                policy_version = results[-1]["next_policy"]
        finally:
            POLICY_ENGINE.close()
    return results


@flow(name="sft")
@artifacts.sent_before_exit
def warm_start(config: RunConfig) -> str:
    """Import the starting model and fine-tune it on demonstrations (sft.steps steps, a stored
    version: found, not trained again, when it exists); returns the policy version RL starts
    from with the same config."""
    use_threads(config.runner.threads)  # a deployment's run starts here, not in `mtrl`
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    with store.lock():
        store.clean_stale_tmp()
        return starting_policy(store, config)


@flow(name="rl-stage")
@artifacts.sent_before_exit
def rerun_stage(config: RunConfig, stage: str, source: str, policy: str | None = None) -> str:
    """Re-run one stage on a stored input (e.g. re-score rewards, or A/B two estimators on the
    same rollouts); writes a new version beside the old one, or finds it already stored.
    `policy`: the policy ppo-update trains (default: the rollouts' generating policy)."""
    use_threads(config.runner.threads)  # a deployment's run starts here, not in `mtrl`
    load_plugins(config.task.plugins)
    store = Store(config.store.runs_dir)
    source_stage, source_version = store.resolve(source)
    rerunnable = {name: table.rerun_from for name, table in STAGES.items() if table.rerun_from}
    if rerunnable.get(stage) != source_stage:
        choices = ", ".join(f"{name} --from {source}/VERSION" for name, source in rerunnable.items())
        raise ValueError(f"`mtrl stage {stage}` cannot run on {source_stage}/VERSION; valid: {choices}")
    with store.lock(), stage_runner(config.runner) as runner:
        version = run_on(stage, config, source_version, runner, policy=policy)
        if stage == "ppo-update":
            prune_lineage(store, config, store.manifest(stage, version).policy)
        return version


def prune_lineage(store: Store, config: RunConfig, policy_version: str) -> None:
    """Retention after a ppo-update is stored whole (its metrics and the policy it wrote): a
    crash before this point re-runs that update, which still finds its policy's AdamW state."""
    keep = config.store.keep_optimizer_state
    pruned = retention.prune_optimizer_states(store, policy_version, keep)
    if pruned:
        get_run_logger().info(
            "retention (store.keep_optimizer_state=%d): pruned the AdamW state of policy %s", keep, ", ".join(pruned)
        )
