"""Where a run is, on its terminal.

On a terminal `mtrl run` keeps one line up to date on stderr:

    mtrl  iteration 4/10  turn 2  41 active  generate-rollouts  2,410 tok/s  1:12 elapsed  ETA 0:58

elsewhere (CI, a file) it writes a plain line when a stage ends. Prefect's flow- and task-run log
lines ("Task run 'execute-tools-3a1' - Finished in state Completed()") go to the run's log file
(RUNS_DIR/logs/run-*.log) instead of the console, unless `mtrl run --verbose`; warnings and errors
still show, and the stages' own progress bars (tqdm) are off while the line is live. Stages report
to it from run_stage (pipeline/orchestration/stage_runs.py): nothing here shapes what a stage writes.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from schemas.manifest import Manifest

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # Prefect's per-run log lines
REDRAW_S = 1.0  # the live line's clock ticks this often between stages


class TerminalProgress:
    """The state of one run as its stages start and end, and its line."""

    def __init__(self, iterations: int, stream: TextIO, live: bool):
        self.iterations, self.stream, self.live = iterations, stream, live
        self.started_at = time.monotonic()
        self.first_iteration_at: float | None = None
        self.iteration: int | None = None
        self.done_iterations = 0
        self.turn: int | None = None
        self.active: int | None = None
        self.stage: str | None = None
        self.tokens_per_s: float | None = None
        self.lock = threading.Lock()

    def started(self, stage: str, position: dict[str, int]) -> None:
        with self.lock:
            self.stage = stage
            if "iteration" in position and position["iteration"] != self.iteration:  # a new iteration
                self.first_iteration_at = self.first_iteration_at or time.monotonic()
                self.iteration, self.turn, self.active = position["iteration"], None, None
            if stage == "generate-rollouts":
                self.turn = position.get("turn")
            self._draw()

    def finished(self, stage: str, manifest: Manifest) -> None:
        with self.lock:
            if stage == "generate-rollouts" and manifest.wall_s:
                self.tokens_per_s = manifest.tokens.get("completion", 0) / manifest.wall_s
            if stage == "execute-tools":
                self.active = manifest.active
            if stage == "ppo-update":
                self.done_iterations += 1
            if not self.live:
                took = f" in {manifest.wall_s:.1f} s" if manifest.wall_s is not None else " (stored)"
                self.stream.write(f"{self.line()}  {stage}{took}\n")
                self.stream.flush()
            self._draw()

    def line(self) -> str:
        """The run's state in one line (the live one ends with the stage under way)."""
        parts = ["mtrl"]
        if self.iteration is not None:
            parts.append(f"iteration {self.iteration + 1}/{self.iterations}")  # the count, not the stored index
        if self.turn is not None:
            parts.append(f"turn {self.turn}")
        if self.active is not None:
            parts.append(f"{self.active} active")
        if self.live and self.stage is not None:
            parts.append(self.stage)
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        parts.append(f"{_clock(time.monotonic() - self.started_at)} elapsed")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        return "  ".join(parts)

    def eta_s(self) -> float | None:
        """The iterations left at the mean pace of the ones done (none before one is done)."""
        if not self.done_iterations or self.first_iteration_at is None:
            return None
        per_iteration = (time.monotonic() - self.first_iteration_at) / self.done_iterations
        return max(0.0, per_iteration * (self.iterations - self.done_iterations))

    def _draw(self) -> None:
        if self.live:  # back to the line's start, the line, the rest of the old one cleared
            self.stream.write(f"\r{self.line()}\x1b[K")
            self.stream.flush()

    def tick(self) -> None:
        with self.lock:
            self._draw()


# The run's line, while `shown` runs. Module-level because the stages report to it from run_stage, inside
# Prefect tasks whose parameters are the stage's inputs: a line handed to them would be part of each task
# run's parameters. Only the `mtrl` command shows a line; elsewhere (a deployment, a test) it is None.
_SHOWN: TerminalProgress | None = None


def stage_started(stage: str, position: dict[str, int]) -> None:
    if _SHOWN is not None:
        _SHOWN.started(stage, position)


def stage_finished(stage: str, manifest: Manifest) -> None:
    if _SHOWN is not None:
        _SHOWN.finished(stage, manifest)


class _NotRunLines(logging.Filter):
    """Keeps Prefect's per-run INFO (and lower) lines off the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(RUN_LOGGERS)


@contextmanager
def shown(iterations: int, log_path: Path, stream: TextIO, verbose: bool = False) -> Iterator[TerminalProgress]:
    """TerminalProgress on `stream` (live when it is a terminal) for the block, and Prefect's run log lines
    written to `log_path` (and, unless `verbose`, not to the console)."""
    global _SHOWN
    log_path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_path)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    root = logging.getLogger()  # Prefect's run loggers propagate to the root's console handler
    root.addHandler(to_file)
    quiet = _NotRunLines()
    consoles = [handler for handler in root.handlers if handler is not to_file] if not verbose else []
    for handler in consoles:
        handler.addFilter(quiet)
    progress = TerminalProgress(iterations, stream, live=stream.isatty() and not verbose)
    ticking = threading.Event()
    ticker = threading.Thread(target=_tick, args=(progress, ticking), name="mtrl-progress", daemon=True)
    _SHOWN = progress
    if progress.live:
        # The stages' own bars (tqdm's decode and ppo-update steps, shown on a terminal only) would break
        # the line: they see a stderr that is not one. Everything written to it still shows.
        sys.stderr = _NotATerminal(sys.stderr)
        ticker.start()
    try:
        yield progress
    finally:
        _SHOWN = None
        ticking.set()
        if progress.live:
            ticker.join()
            stream.write(f"\r{progress.line()}\x1b[K\n")
            stream.flush()
        if isinstance(sys.stderr, _NotATerminal):
            sys.stderr = sys.stderr.stream
        for handler in consoles:
            handler.removeFilter(quiet)
        root.removeHandler(to_file)
        to_file.close()


class _NotATerminal:
    """A stream that writes to `stream` but does not say it is a terminal."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # write, flush, fileno, encoding...: the stream's
        return getattr(self.stream, name)


def _tick(progress: TerminalProgress, stop: threading.Event) -> None:
    while not stop.wait(REDRAW_S):
        progress.tick()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
