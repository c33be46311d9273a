"""Where a run is, on its terminal (pipeline/monitoring/progress.py): a live line on a terminal, plain lines
elsewhere, and Prefect's per-run log lines in the run's log file instead of the console."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.monitoring.progress import TerminalProgress
from schemas.manifest import Manifest


def manifest(stage: str, **fields) -> Manifest:
    return Manifest(stage=stage, version="v", created_at="now", **fields)


def test_a_plain_line_per_stage_with_iteration_turn_active_rollouts_tokens_per_second_and_eta():
    out = io.StringIO()  # not a terminal: plain lines
    progress = TerminalProgress(iterations=2, stream=out, live=False)
    progress.started("generate-rollouts", {"iteration": 0, "turn": 1})
    progress.finished("generate-rollouts", manifest("generate-rollouts", wall_s=2.0, tokens={"completion": 3000}))
    progress.started("execute-tools", {"iteration": 0, "turn": 1})
    progress.finished("execute-tools", manifest("execute-tools", wall_s=0.5, active=7))
    # the clock's fields read the wall clock: their form is checked, not their value
    lines = [re.sub(r"\d+:\d\d elapsed", "M:SS elapsed", line) for line in out.getvalue().splitlines()]
    assert lines == [
        "mtrl  iteration 1/2  turn 1  1,500 tok/s  M:SS elapsed  generate-rollouts in 2.0 s",
        "mtrl  iteration 1/2  turn 1  7 active  1,500 tok/s  M:SS elapsed  execute-tools in 0.5 s",
    ]
    assert progress.eta_s() is None  # no iteration done yet
    progress.finished("ppo-update", manifest("ppo-update", wall_s=1.0))
    assert progress.eta_s() is not None
    assert re.search(r"ETA \d+:\d\d  ppo-update in 1\.0 s$", out.getvalue().splitlines()[-1])
    assert "\r" not in out.getvalue()


@pytest.mark.slow
def test_a_run_on_a_terminal_keeps_one_live_line_and_sends_prefects_run_lines_to_its_log_file(tmp_path):
    """`mtrl run` with its stderr on a pseudo-terminal: the line is redrawn in place (carriage returns,
    no newline until the end) and shows the last iteration; no Prefect task-run line reaches the
    terminal, the run's log file has them."""
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs), "--iterations", "2"]
    command += ["--rollouts", "8", "--group-size", "4"]
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower, cwd=Path(__file__).parents[1])
    os.close(follower)
    seen = b""
    while True:  # read the terminal until the run closes it
        ready, _, _ = select.select([leader], [], [], 300)
        assert ready, "no output for 300 s"
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the run exited: the terminal is gone
            break
        if not chunk:
            break
        seen += chunk
    assert process.wait(timeout=60) == 0
    terminal = seen.decode(errors="replace")
    assert terminal.count("\r") >= 10 and "iteration 2/2" in terminal and "ETA" in terminal
    assert terminal.rstrip("\r\n").count("\n") <= 1  # one line, redrawn (the last redraw ends it)
    assert "Task run" not in terminal and "prefect.task_runs" not in terminal
    (log,) = (runs / "logs").glob("run-*.log")
    assert "prefect.task_runs" in log.read_text() and (runs / "logs" / f"{log.stem}.json").exists()
