"""Re-run one stored execute-tools turn in a fresh process and compare the data (a helper for the
tests of stateful environments: a game, an OpenEnv session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.store.diff import compare_runs
from pipeline.store.versions import Store

ROOT = Path(__file__).resolve().parent.parent


def rerun_turn_elsewhere(runs_dir: Path, tools_version: str, work: Path) -> tuple[list[str], int]:
    """Copy the runs directory, delete this execute-tools version from the copy, make it again with
    `mtrl stage execute-tools --from generate-rollouts/...` in a new process (no live game or
    session of the run survives there), and compare the copy with the original (`mtrl diff`):
    the lines and how many items differ."""
    copy = work / "copy"
    shutil.copytree(runs_dir, copy)
    store = Store(copy)
    generated = store.manifest("execute-tools", tools_version).parents["generate-rollouts"]
    shutil.rmtree(store.path("execute-tools", tools_version))
    from prefect.settings import PREFECT_API_URL

    command = [sys.executable, "-m", "pipeline.cli", "stage", "execute-tools", "--runs-dir", str(copy)]
    command += ["--from", f"generate-rollouts/{generated}"]
    environment = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session's test server
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert store.exists("execute-tools", tools_version), done.stdout  # the same inputs give the same version
    return compare_runs(runs_dir, copy)
