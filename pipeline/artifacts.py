"""What an mtrl run shows in the Prefect UI (docs/prefect-ui.md): a table per stage version, a
progress bar for the long stages, and per iteration the learning curve, plot and table.

The stage functions (stages/) know nothing of Prefect: they take a plain `report_progress`
callback, called with the share of their work done (0 to 1), which the functions here turn
into updates of a Prefect progress artifact.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from pipeline.report import iterations, markdown_table, write_files
from pipeline.store import Store

SUMMARY_KEY = "rl-iteration-summary"
GENERATION_PROGRESS_KEY = "generate-rollouts-progress"
PPO_PROGRESS_KEY = "ppo-update-progress"
UPDATE_INTERVAL_S = 1.0  # a callback fires per token or step; the API hears at most once a second


def publish_stage(store: Store, stage: str, version: str) -> None:
    """A Prefect table artifact per stage version: rows, tokens, wall time and its metrics."""
    manifest = store.manifest(stage, version)
    table = {"version": version, "rows": manifest.rows, "wall_s": manifest.wall_s, **manifest.tokens}
    for name, value in {**manifest.metrics, **manifest.extra("tool_failures", {})}.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            table[name] = round(value, 4) if isinstance(value, float) else value
    create_table_artifact(key=stage, table=[table], description=f"{stage}/{version} in {store.root}")


def publish_summary(store: Store, policy_version: str) -> None:
    """The learning curve so far as one markdown artifact: the plot, embedded as a data URL
    (both Prefect UIs render `data:image/...` sources in markdown, while an image artifact
    needs a URL the browser can reach), above the table; also written to the runs dir."""
    rows = iterations(store, policy_version)
    png = write_files(rows, store.root / "report")
    encoded = base64.b64encode(png.read_bytes()).decode("ascii")
    create_markdown_artifact(
        key=SUMMARY_KEY,
        markdown="\n\n".join(
            [
                f"## mtrl learning curve, iteration {rows[-1]['iteration']}",
                f"![learning curve](data:image/png;base64,{encoded})",
                markdown_table(rows),
                f"Plot: `{png}`, store: `{store.root}`",
            ]
        ),
        description="success, reward, turns and training metrics per iteration",
    )


class Progress:
    """A Prefect progress artifact (0-100 %). A new percentage is sent at most once per
    UPDATE_INTERVAL_S, at once if it is 100 % or comes with a new description. Each holder
    of the artifact (one per task run) keeps its own clock."""

    def __init__(self, artifact_id: UUID):
        self.artifact_id = artifact_id
        self._sent_percent = 0.0
        self._sent_at = time.monotonic()

    @classmethod
    def create(cls, key: str, description: str) -> Progress:
        """A new bar at 0 %, attached to the current flow or task run."""
        return cls(create_progress_artifact(0.0, key=key, description=description))

    def update(self, percent: float, description: str | None = None) -> None:
        percent, now = round(percent, 1), time.monotonic()  # the UI prints every digit it gets
        if description is None and (
            percent <= self._sent_percent or (percent < 100 and now - self._sent_at < UPDATE_INTERVAL_S)
        ):
            return
        try:
            update_progress_artifact(self.artifact_id, percent, description=description)
        except Exception as exc:  # a progress bar must never fail a long stage: say so, carry on
            get_run_logger().warning("progress artifact %s not updated: %s", self.artifact_id, exc)
        self._sent_percent, self._sent_at = percent, now

    def finish(self, description: str) -> None:
        self.update(100.0, description)


def generation_progress(iteration: int, turn_limit: int) -> Progress:
    """One bar for all of an iteration's turns, attached to the flow run: someone watching a
    long multi-turn run wants to know how many turns are done, and how far the current one is."""
    return Progress.create(GENERATION_PROGRESS_KEY, f"iteration {iteration}: turn 1 of at most {turn_limit}")


def turn_progress(artifact_id: UUID, iteration: int, turn: int, turn_limit: int) -> Callable[[float], None]:
    """A generate-rollouts callback: the share of turn `turn` decoded moves the iteration's
    bar from turn/turn_limit to (turn + 1)/turn_limit; the end of a turn is always sent."""
    progress = Progress(artifact_id)

    def report(decoded: float) -> None:
        done = f"iteration {iteration}: {turn + 1} of at most {turn_limit} turns generated" if decoded >= 1 else None
        progress.update(100 * (turn + decoded) / turn_limit, done)

    return report


def ppo_progress(iteration: int) -> Callable[[float], None]:
    """A ppo-update callback: a bar of the optimiser steps done, attached to the task run."""
    progress = Progress.create(PPO_PROGRESS_KEY, f"iteration {iteration}: optimiser steps done")
    return lambda done: progress.update(100 * done)
