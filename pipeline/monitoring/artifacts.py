"""What an mtrl run shows in the Prefect UI (docs/prefect-ui.md): a table per stage version, a
progress bar for the long stages, and per iteration the learning curve's table (with the plot
at the end of a run).

The stage functions (stages/) know nothing of Prefect: they take a plain `report_progress`
callback, called with the share of their work done (0 to 1), which the functions here turn
into updates of a Prefect progress artifact.

Every artifact is sent by one background thread, in the order the calls were made and in the
caller's Prefect run context (so it lands on the same flow or task run), through the thread's
own API client: neither a stage nor a flow waits for the API's round trips (each one 5-60 ms,
~150 per default run). A run's client closes when the run ends; this one stays open until the
process exits. Only the outermost flow run of a process waits for what is still queued, as it
ends (sent_before_exit). An artifact the API refuses is a warning in the run's log, never a
failed stage: the store, not the UI, is the truth.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL

from pipeline.monitoring.report import iteration_row, markdown_table, write_files
from pipeline.prefect_plumbing.patches import call_with_own_client
from pipeline.store.versions import Store
from runtime.phases import PHASES
from schemas.manifest import Manifest

SUMMARY_KEY = "rl-iteration-summary"
GENERATION_PROGRESS_KEY = "generate-rollouts-progress"
UPDATE_INTERVAL_S = 1.0  # a callback fires per token or step; the API hears at most once a second

_sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtrl-artifacts")  # one thread: calls keep their order


def send(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Run an artifact API call on the background thread, in the caller's run context."""
    context = contextvars.copy_context()

    def run() -> Any:
        try:
            return context.run(call_with_own_client, PREFECT_API_URL.value(), call, *args, **kwargs)
        except Exception as exc:
            context.run(get_run_logger).warning("Prefect artifact not sent: %s: %s", type(exc).__name__, exc)
            raise

    return _sender.submit(run)


@PHASES.timed("artifacts")
def flush() -> None:
    """Wait until every artifact sent so far has reached the API (or failed, with its warning)."""
    _sender.submit(lambda: None).result()


FlowFunction = TypeVar("FlowFunction", bound=Callable[..., Any])


def sent_before_exit(flow_function: FlowFunction) -> FlowFunction:
    """Decorates a flow's function (below @flow): when it ends, raising or not, as the outermost
    flow run of its process (`mtrl run`, a deployment's flow run: the process may exit right
    after), it waits for every artifact still queued. Left to the thread pool's exit hook, such
    an artifact still reached the API, but Prefect's event for it did not: Prefect's events
    worker had stopped by then and a new one cannot start during shutdown (a traceback, "can't
    register atexit after shutdown", in the run's output). A subflow does not wait: its parent
    does, once."""

    @functools.wraps(flow_function)
    def run_then_flush(*args: Any, **kwargs: Any) -> Any:
        outermost = FlowRunContext.get().flow_run.parent_task_run_id is None
        try:
            return flow_function(*args, **kwargs)
        finally:
            if outermost:
                flush()

    return run_then_flush  # type: ignore[return-value]


@PHASES.timed("artifacts")
def publish_stage(store: Store, stage: str, version: str) -> None:
    """A Prefect table artifact per stage version: rows, tokens, wall time and its metrics."""
    manifest = store.manifest(stage, version)
    table = {"version": version, "rows": manifest.rows, "wall_s": manifest.wall_s, **manifest.tokens}
    for name, value in {**manifest.metrics, **manifest.extra("tool_failures", {})}.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            table[name] = round(value, 4) if isinstance(value, float) else value
    send(create_table_artifact, key=stage, table=[table], description=f"{stage}/{version} in {store.root}")


@PHASES.timed("artifacts")
def publish_summary(store: Store, made_by_iteration: list[list[Manifest]], plot: bool) -> None:
    """The learning curve so far (the versions each iteration made: lineage.iteration_versions) as
    one markdown artifact: with `plot`, the plot embedded as a data URL (both Prefect UIs render
    `data:image/...` sources in markdown, while an image artifact needs a URL the browser can reach)
    above the table; also written to the runs dir. Rendering the plot takes ~0.15 s (2 cores), so a
    run of several iterations plots once, at its end; every iteration publishes the table."""
    rows = [iteration_row(made) for made in made_by_iteration]
    table = markdown_table(rows)
    png = write_files(rows, store.root / "report", plot=plot)
    sections = [f"## mtrl learning curve, iteration {rows[-1]['iteration']}"]
    if plot:
        encoded = base64.b64encode(png.read_bytes()).decode("ascii")
        sections.append(f"![learning curve](data:image/png;base64,{encoded})")
    sections += [table, f"Plot: `{png}`, store: `{store.root}`" if plot else f"Store: `{store.root}`"]
    send(
        create_markdown_artifact,
        key=SUMMARY_KEY,
        markdown="\n\n".join(sections),
        description="success, reward, turns and training metrics per iteration",
    )


class ProgressArtifact:
    """A Prefect progress artifact (0-100 %). A new percentage is sent at most once per
    UPDATE_INTERVAL_S, at once if it is 100 % or comes with a new description. Each holder
    of the artifact (one per task run) keeps its own clock."""

    def __init__(self, artifact: UUID | Future):
        if isinstance(artifact, UUID):
            artifact, artifact_id = Future(), artifact
            artifact.set_result(artifact_id)
        self._artifact = artifact
        self._sent_percent = 0.0
        self._sent_at = time.monotonic()

    @classmethod
    def create(cls, key: str, description: str) -> ProgressArtifact:
        """A new bar at 0 %, attached to the current flow or task run."""
        return cls(send(create_progress_artifact, 0.0, key=key, description=description))

    @property
    def artifact_id(self) -> UUID | None:
        """The bar's id once the API created it (task runs that update it take it as a
        parameter); None if the API refused it (warned about when sent)."""
        try:
            return self._artifact.result()
        except Exception:
            return None

    def update(self, percent: float, description: str | None = None) -> None:
        percent, now = round(percent, 1), time.monotonic()  # the UI prints every digit it gets
        if description is None and (
            percent <= self._sent_percent or (percent < 100 and now - self._sent_at < UPDATE_INTERVAL_S)
        ):
            return

        def send_update() -> None:  # queued after the bar's creation, on the same thread: its id is known
            if self.artifact_id is not None:
                update_progress_artifact(self.artifact_id, percent, description=description)

        send(send_update)
        self._sent_percent, self._sent_at = percent, now

    def finish(self, description: str) -> None:
        self.update(100.0, description)


@PHASES.timed("artifacts")
def generation_progress(iteration: int, turn_limit: int) -> ProgressArtifact:
    """One bar for all of an iteration's turns, attached to the flow run: someone watching a
    long multi-turn run wants to know how many turns are done, and how far the current one is."""
    return ProgressArtifact.create(GENERATION_PROGRESS_KEY, f"iteration {iteration}: turn 1 of at most {turn_limit}")


def turn_stretch(progress: ProgressArtifact, iteration: int, turn: int, turn_limit: int) -> dict[str, Any] | None:
    """The stretch of the iteration's generation bar that turn `turn` moves (stretch_of): from
    turn/turn_limit to (turn + 1)/turn_limit; None when the API refused the bar."""
    if progress.artifact_id is None:
        return None
    done = f"iteration {iteration}: {turn + 1} of at most {turn_limit} turns generated"
    return {"artifact": progress.artifact_id, "start": turn / turn_limit, "end": (turn + 1) / turn_limit, "done": done}


def stretch_of(artifact: UUID, start: float, end: float, done: str) -> Callable[[float], None]:
    """A stage's progress callback (the share of its work done, 0 to 1) that moves a bar from
    `start` to `end` (shares of the bar), and says `done` at its end."""
    progress = ProgressArtifact(artifact)

    def report(share: float) -> None:
        progress.update(100 * (start + share * (end - start)), done if share >= 1 else None)

    return report


def bar_of_its_own(stage: str) -> Callable[[float], None]:
    """A stage's progress callback that makes a bar of its own (key STAGE-progress), attached to its
    task run, when it first reports (a stage that never reports makes none)."""
    made: list[ProgressArtifact] = []

    def report(share: float) -> None:
        if not made:
            made.append(ProgressArtifact.create(f"{stage}-progress", f"{stage}: share of the work done"))
        made[0].update(100 * share)

    return report
