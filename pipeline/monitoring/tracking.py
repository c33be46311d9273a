"""Experiment trackers (tracking.backends): each iteration of a run logged to TensorBoard, MLflow,
W&B or trackio, beside the user's other runs (docs/tracking.md).

The store is the record and a tracker a copy of it, made from the manifests and datasets once an
iteration's ppo-update is stored (`log_iteration`, called by rl-iteration). A tracker must never
fail or slow a run: its library is imported only when it is named, each one works in a daemon
thread that the iteration waits for at most tracking.timeout_s (a thread left hanging never holds
up the exit), and one that fails or does not answer warns once and is not used again by the
process; the next process tries it again and logs what it missed.

A tracker run spans processes: a resumed run (even after a SIGKILL) and each deployment run
continue the run whose id the tracker's ledger in tracking.dir holds (`Ledger`), and log the
iterations of the lineage that the ledger does not list yet, oldest first. An iteration is
listed once its tracker has flushed it, so none is logged twice (only a kill between a flush and
the ledger's write, a few milliseconds, would log that iteration again).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from pipeline.store.versions import Store
from runtime.files import replace_file
from runtime.hashing import library_versions, package_version
from runtime.phases import PHASES
from schemas.config import RunConfig, TrackingConfig
from schemas.manifest import Manifest

TRAJECTORY_COLUMNS = ["iteration", "rollout_id", "group_id", "task", "turns", "text", "reward", "advantage"]
TEXT_LIMIT = 4000  # characters of a trajectory's text in the table: a tracker's table is a glimpse, the store has all


@dataclass(frozen=True)
class Table:
    """A small table (the sample trajectories), as every tracker library takes one."""

    columns: list[str]
    rows: list[list[Any]]


@dataclass(frozen=True)
class Step:
    """What one iteration logs (step = iteration)."""

    iteration: int
    policy: str  # the policy it wrote: which lineage the step belongs to
    scalars: dict[str, float]
    trajectories: Table | None


class Tracker(ABC):
    """One tracker library behind the interface the run needs. `start` starts a run, or resumes
    the one of `run_id` (a previous process's), and returns its id; `log_config` once per tracker
    run; `log` one step's scalars and its table together (W&B and trackio write a step in one
    call); `flush` makes what was logged durable (the ledger lists the step next); `finish` at the
    process's exit."""

    name: ClassVar[str]
    library: ClassVar[str]  # its distribution, whose version the config records

    def __init__(self, settings: TrackingConfig, folder: Path):
        self.settings, self.folder = settings, folder

    @abstractmethod
    def start(self, run_id: str | None, run_name: str) -> str: ...

    @abstractmethod
    def log_config(self, values: dict[str, Any]) -> None: ...

    @abstractmethod
    def log(self, step: int, scalars: dict[str, float], table: Table | None) -> None: ...

    @abstractmethod
    def flush(self) -> None: ...

    @abstractmethod
    def finish(self) -> None: ...


class TensorBoardTracker(Tracker):
    """Event files in tracking.dir/tensorboard/<run name> (`tensorboard --logdir` that folder); a
    resumed run adds an event file to the same folder, which TensorBoard reads as one run."""

    name, library = "tensorboard", "tensorboard"

    def start(self, run_id: str | None, run_name: str) -> str:
        from torch.utils.tensorboard import SummaryWriter

        run_id = run_id or run_name
        self.writer = SummaryWriter(str(self.folder / "tensorboard" / run_id))
        return run_id

    def log_config(self, values: dict[str, Any]) -> None:
        self.writer.add_text("config", markdown_table(["field", "value"], [[k, v] for k, v in values.items()]), 0)

    def log(self, step: int, scalars: dict[str, float], table: Table | None) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        if table is not None:
            self.writer.add_text("trajectories", markdown_table(table.columns, table.rows), step)

    def flush(self) -> None:
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    """A run of experiment tracking.project on the server at tracking.mlflow_uri, or in a local
    SQLite store (tracking.dir/mlflow.db, artifacts beside it: `mlflow ui --backend-store-uri
    sqlite:///.../mlflow.db`). The trajectory table is a JSON artifact per iteration."""

    name, library = "mlflow", "mlflow-skinny"

    def start(self, run_id: str | None, run_name: str) -> str:
        # MLflow's client retries a refused request 7 times with exponential backoff and waits up to
        # 120 s for an answer; a dead server would keep this thread busy for minutes after the
        # iteration stopped waiting for it. Only where the user has not chosen otherwise.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(math.ceil(self.settings.timeout_s)))
        from mlflow import MlflowClient

        local = self.settings.mlflow_uri is None
        self.client = MlflowClient(self.settings.mlflow_uri or f"sqlite:///{self.folder / 'mlflow.db'}")
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        experiment = self.client.get_experiment_by_name(self.settings.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a local store's artifacts go beside it, not into ./mlruns of wherever mtrl was started
            artifacts = (self.folder / "mlflow-artifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(self.settings.project, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        return self.run_id

    def log_config(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # a parameter's value holds at most 6000 characters (MLflow's limit)
        self.client.log_batch(self.run_id, params=[Param(k, json_text(v)[:6000]) for k, v in values.items()])

    def log(self, step: int, scalars: dict[str, float], table: Table | None) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])
        if table is not None:
            document = {"columns": table.columns, "data": table.rows}  # the layout of MLflow's own log_table
            self.client.log_dict(self.run_id, document, f"trajectories/iteration_{step:05d}.json")

    def flush(self) -> None:
        """Nothing to wait for: each call returns once the store or server holds what it sent."""

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker(Tracker):
    """A W&B run of project tracking.project, online or offline as W&B's settings say (WANDB_MODE).
    W&B writes a run's records from a service process of its own, which a kill of the process
    group takes down before it has written the last ones: only finish() waits until they are
    written, so every flush finishes the run and the next step resumes it. An offline run cannot be
    resumed: each of its stretches is a folder of tracking.dir/wandb with the run's id."""

    name, library = "wandb", "wandb"

    def start(self, run_id: str | None, run_name: str) -> str:
        self.run_id, self.run_name = run_id or run_name, run_name
        self.run = self.resumed()
        return self.run_id

    def resumed(self) -> Any:
        import wandb

        offline = wandb.setup().settings.mode in ("offline", "dryrun")
        settings = wandb.Settings(
            console="off",  # W&B would otherwise wrap this process's stdout and stderr
            x_disable_stats=True,  # no sampling thread for system metrics
            init_timeout=self.settings.timeout_s,
            silent=True,
        )
        return wandb.init(
            project=self.settings.project,
            dir=str(self.folder),
            id=self.run_id,
            name=self.run_name,
            resume=None if offline else "allow",  # offline, W&B would warn that it ignores it
            settings=settings,
        )

    def log_config(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, step: int, scalars: dict[str, float], table: Table | None) -> None:
        import wandb

        self.run = self.run or self.resumed()
        tables = {} if table is None else {"trajectories": wandb.Table(columns=table.columns, data=table.rows)}
        self.run.log({**scalars, **tables}, step=step, commit=True)

    def flush(self) -> None:
        self.run.finish()
        self.run = None

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class TrackioTracker(Tracker):
    """A trackio run of project tracking.project, stored locally in tracking.dir/trackio (its
    TRACKIO_DIR, unless set: `trackio show --project mtrl` with the same TRACKIO_DIR)."""

    name, library = "trackio", "trackio"

    def start(self, run_id: str | None, run_name: str) -> str:
        os.environ.setdefault("TRACKIO_DIR", str(self.folder / "trackio"))  # trackio reads it when imported
        import trackio

        self.run = trackio.init(
            project=self.settings.project,
            name=run_id or run_name,
            resume="allow",
            embed=False,
            auto_log_cpu=False,  # no sampling threads for system metrics
            auto_log_gpu=False,
        )
        return self.run.name

    def log_config(self, values: dict[str, Any]) -> None:
        self.run.config.update(values)  # trackio records the config with the run's next log

    def log(self, step: int, scalars: dict[str, float], table: Table | None) -> None:
        import trackio

        tables = {} if table is None else {"trajectories": trackio.Table(columns=table.columns, data=table.rows)}
        self.run.log({**scalars, **tables}, step=step)

    def flush(self) -> None:
        # trackio writes its queue to SQLite every 0.5 s from a thread of its own, and has no public
        # flush but finish(); this is what that thread does (trackio==0.43.0, the `tracking` extra's pin)
        with self.run._client_lock:
            self.run._flush_queues_inline()

    def finish(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type[Tracker]] = {
    tracker.name: tracker for tracker in (TensorBoardTracker, MLflowTracker, WandbTracker, TrackioTracker)
}


@dataclass
class Ledger:
    """What one tracker logged of the run of a tracking dir (tracking.dir/<tracker>.json): its run's
    id, whether the config was logged, and each logged iteration with the policy it wrote."""

    path: Path
    run_id: str | None = None
    config_logged: bool = False
    steps: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Ledger:
        if not path.is_file():
            return cls(path)
        data = json.loads(path.read_text())
        steps = {int(iteration): policy for iteration, policy in data["steps"].items()}
        return cls(path, data["run_id"], data["config_logged"], steps)

    def save(self) -> None:
        data = {"run_id": self.run_id, "config_logged": self.config_logged, "steps": self.steps}
        replace_file(self.path, (json.dumps(data, indent=1) + "\n").encode())


# A tracker's run stays open from one iteration to the next, and each iteration is a flow run of its own
# (rl_iteration: `mtrl run` calls it once per iteration; a deployment's serving process runs one per
# trigger): no object lives as long as the process's iterations, so the process's trackers are kept here,
# by name and tracking dir, and each is finished when the process exits (atexit: _finish).
_OPEN: dict[tuple[str, Path], Tracker] = {}
_FAILED: set[tuple[str, Path]] = set()  # the trackers that failed in this process (warned about once)


def tracking_dir(config: RunConfig) -> Path:
    return (config.tracking.dir or config.store.runs_dir / "tracking").resolve()


@PHASES.timed("tracking")
def log_iteration(config: RunConfig, store: Store, made_by_iteration: list[list[Manifest]]) -> None:
    """Log to each tracker of tracking.backends the iterations of a policy's lineage (the versions each
    made: lineage.iteration_versions) it has not logged yet (normally the one that just wrote the
    policy), waiting at most tracking.timeout_s."""
    settings, folder = config.tracking, tracking_dir(config)
    names = [name for name in settings.backends if (name, folder) not in _FAILED]
    if not names:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        ledgers = {name: Ledger.load(folder / f"{name}.json") for name in names}
        lineage = {made[0].iteration: made for made in made_by_iteration}
        wanted = {}
        for name, ledger in ledgers.items():
            other = [i for i, wrote in ledger.steps.items() if i in lineage and lineage[i][0].policy != wrote]
            if other:
                _fail(name, folder, f"{folder} holds another run's iteration {other[0]}: give this run a tracking.dir")
            else:
                wanted[name] = sorted(i for i in lineage if i not in ledger.steps)
        iterations = sorted({i for steps in wanted.values() for i in steps})
        steps = {i: step_of(store, lineage[i], settings.trajectories) for i in iterations}
        run_name = run_name_of(folder, store)
    except Exception as error:  # a store or disk that cannot be read or written: no tracker logs this time
        for name in names:
            _fail(name, folder, error)
        return
    calls: dict[str, Callable[[], None]] = {}
    for name, missing in wanted.items():
        if missing:
            todo = [steps[i] for i in missing]
            calls[name] = functools.partial(_log_steps, name, settings, ledgers[name], run_name, config, todo)
    for name, error in in_daemon_threads(calls, settings.timeout_s).items():
        if error is not None:
            _fail(name, folder, error)


def _log_steps(
    name: str, settings: TrackingConfig, ledger: Ledger, run_name: str, config: RunConfig, steps: list[Step]
) -> None:
    """In a tracker's thread: start or resume its run, log the config once, then the steps in order,
    each one listed in the ledger once the tracker has flushed it."""
    key = (name, ledger.path.parent)
    tracker = _OPEN.get(key)
    if tracker is None:
        tracker = TRACKERS[name](settings, ledger.path.parent)
        ledger.run_id = tracker.start(ledger.run_id, run_name)
        ledger.save()  # the run's id first: a process killed before its first step still continues this run
        _OPEN[key] = tracker
        # registered after the library's own exit hooks, so that it runs before them (last in, first out)
        atexit.register(_finish, key, settings.timeout_s)
    if not ledger.config_logged:
        tracker.log_config(config_values(config, tracker))
        ledger.config_logged = True
        ledger.save()
    for step in steps:
        tracker.log(step.iteration, step.scalars, step.trajectories)
        tracker.flush()
        ledger.steps[step.iteration] = step.policy
        ledger.save()


def _finish(key: tuple[str, Path], timeout_s: float) -> None:
    """At exit: finish a tracker's run (its status, its last buffers), waiting at most timeout_s."""
    tracker = _OPEN.pop(key, None)
    if tracker is None or key in _FAILED:
        return
    error = in_daemon_threads({key[0]: tracker.finish}, timeout_s)[key[0]]
    if error is not None:
        _fail(*key, error)


def in_daemon_threads(calls: dict[str, Callable[[], None]], timeout_s: float) -> dict[str, BaseException | None]:
    """Run each call in a daemon thread of its own and wait for them at most timeout_s in all;
    returns each call's error (a TimeoutError for one still running). Daemon threads, not a pool's:
    a call that hangs on a dead server is abandoned, and the interpreter's exit does not join it."""
    futures: dict[str, Future] = {}
    for name, call in calls.items():
        future: Future = Future()

        def run(call: Callable[[], None] = call, future: Future = future) -> None:
            try:
                future.set_result(call())
            except BaseException as error:  # reported by the caller, whatever the library raised
                future.set_exception(error)

        threading.Thread(target=run, name=f"mtrl-tracking-{name}", daemon=True).start()
        futures[name] = future
    wait(futures.values(), timeout=timeout_s)
    late = TimeoutError(f"no answer within tracking.timeout_s = {timeout_s:g} s")
    return {name: future.exception() if future.done() else late for name, future in futures.items()}


def _fail(name: str, folder: Path, error: BaseException | str) -> None:
    """Warn once that a tracker failed; this process does not use it again (the run goes on)."""
    _FAILED.add((name, folder))
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    message = f"tracker {name} failed and is off for the rest of this process (the run goes on): {reason}"
    try:
        logger = get_run_logger()
    except MissingContextError:  # at exit, after the flow run
        logger = logging.getLogger(__name__)
    logger.warning(message)


def run_name_of(folder: Path, store: Store) -> str:
    """The tracker runs' name, the same in every tracker: the runs dir's name and a random suffix
    (names like `runs` repeat from one experiment to the next), chosen once per tracking dir."""
    path = folder / "run-name"
    if not path.is_file():
        replace_file(path, f"{store.root.name}-{secrets.token_hex(3)}".encode())
    return path.read_text()


def config_values(config: RunConfig, tracker: Tracker) -> dict[str, Any]:
    """The run config as flat `section.field` values, and the library versions
    (`versions/<library>`): those a manifest records and the tracker's own."""
    values = flatten(config.model_dump(mode="json"))
    versions = {**library_versions(), tracker.library: package_version(tracker.library) or "absent"}
    return values | {f"versions/{name}": version for name, version in versions.items()}


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def step_of(store: Store, made: list[Manifest], trajectories: int) -> Step:
    """An iteration's step, from the versions it made (pipeline.store.lineage.iteration_versions)."""
    update = made[0]
    table = sample_trajectories(store, made, trajectories) if trajectories else None
    return Step(update.iteration, update.policy, scalars_of(made), table)


def scalars_of(made: list[Manifest]) -> dict[str, float]:
    """An iteration's scalars by family: rollout/ (assign-rewards' metrics, per task too), train/
    (ppo-update's), time/ (wall seconds per stage, summed over turns), data/ (rows, tokens, turns,
    failed rollouts), tools/ (tool-call failures by kind), audit/ and passes/ (model passes)."""
    scalars: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):  # None: no such rollout
            scalars[name] = scalars.get(name, 0.0) + float(value)

    update, rewards = made[0], next(m for m in made if m.stage == "assign-rewards")
    for key, value in rewards.metrics.items():
        if key == "per_task":
            for task, metrics in value.items():
                for name, number in metrics.items():
                    add(f"rollout/{task}/{name}", number)
        else:
            add(f"rollout/{key}", value)
    for key, value in update.metrics.items():
        add(f"train/{key}", value)
    add("data/turns", sum(manifest.stage == "execute-tools" for manifest in made))
    add("data/failed_rollouts", round(rewards.metrics["rollouts"] * rewards.metrics["failed_rate"]))
    for kind, count in rewards.tokens.items():
        add(f"data/tokens/{kind}", count)
    for manifest in made:
        add("time/stage_s", manifest.wall_s)  # mtrl report's "stage s"
        add(f"time/{manifest.stage}_s", manifest.wall_s)
        add(f"data/rows/{manifest.stage}", manifest.rows)
        for kind, count in manifest.extra("tool_failures", {}).items():
            add(f"tools/{kind}", count)
        for kind, counts in (manifest.extra("passes") or {}).items():
            add(f"passes/{kind}/passes", counts["passes"])
            add(f"passes/{kind}/tokens", counts["tokens"])
    audit = update.extra("audit")
    if audit is not None:
        add("audit/ok", int(audit["ok"]))
        add("audit/problems", len(audit["problems"]))
        add("audit/rescore_max_abs_diff", audit.get("rescore_max_abs_diff"))
        for kind, counts in audit.get("passes", {}).items():
            add(f"passes/{kind}/passes", counts["passes"])
            add(f"passes/{kind}/tokens", counts["tokens"])
    return scalars


def sample_trajectories(store: Store, made: list[Manifest], count: int) -> Table:
    """`count` rollouts of the iteration, spread evenly over its rollout ids (several groups), each
    one row: its turns' text (reasoning, reply, tool results), reward and mean advantage."""
    advantaged = next(m for m in made if m.stage == "compute-advantages")
    turns = store.load("compute-advantages", advantaged.version)
    ids = sorted(set(turns["rollout_id"]))
    chosen = {ids[k * len(ids) // count] for k in range(min(count, len(ids)))}
    columns = ["rollout_id", "group_id", "task", "turn", "thinking", "content", "observation", "failure"]
    by_rollout: dict[int, list[dict[str, Any]]] = {}
    for row in turns.select_columns([*columns, "reward", "advantages"]):
        if row["rollout_id"] in chosen:
            by_rollout.setdefault(row["rollout_id"], []).append(row)
    rows = []
    for rollout_id, its_turns in sorted(by_rollout.items()):
        its_turns.sort(key=lambda row: row["turn"])
        first, reward = its_turns[0], its_turns[0]["reward"]
        advantages = [a for row in its_turns for a in row["advantages"]]
        rows.append(
            [
                made[0].iteration,
                rollout_id,
                first["group_id"],
                first["task"],
                len(its_turns),
                trajectory_text(its_turns),
                None if reward is None or math.isnan(reward) else reward,  # NaN: a failed rollout
                sum(advantages) / len(advantages) if advantages else None,
            ]
        )
    return Table(TRAJECTORY_COLUMNS, rows)


def trajectory_text(turns: list[dict[str, Any]]) -> str:
    parts = []
    for row in turns:
        thinking = f"<think>{row['thinking']}</think> " if row["thinking"] else ""
        parts.append(f"[turn {row['turn']}] assistant: {thinking}{row['content']}")
        if row["observation"]:
            parts.append(f"[turn {row['turn']}] tool: {row['observation']}")
        if row["failure"]:
            parts.append(f"[turn {row['turn']}] failed: {row['failure']}")
    text = "\n".join(parts)
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 1] + "…"


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (TensorBoard's text plugin renders it), one line per row."""

    def cell(value: Any) -> str:
        return json_text(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows])


def json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
