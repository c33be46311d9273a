"""SIGKILL `mtrl run --agent ...` while its agents run, then run the same command again: it resumes to
the data of a run never interrupted (`mtrl diff`: every byte), and the agents' process dies with mtrl.
Slow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.store import Store

pytestmark = pytest.mark.slow
ARGS = ["--iterations", "3", "--rollouts", "8", "--group-size", "4", "--agent", "examples.agents.openai_loop:agent"]


def start(runs_dir: Path, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *ARGS]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def agent_processes(parent: int | None = None) -> set[int]:
    """The agents' processes running now (of `parent`, when given)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
            parent_id = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"generate_rollouts/agents/child.py" in command and parent in (None, parent_id):
            found.add(int(entry.name))
    return found


def test_sigkill_while_agents_run_then_the_same_command_resumes_to_the_uninterrupted_data(
    tmp_path, prefect_server_env, capsys
):
    reference = tmp_path / "uninterrupted"
    assert start(reference, prefect_server_env).wait(timeout=600) == 0

    faulted = tmp_path / "faulted"
    process = start(faulted, prefect_server_env)
    deadline = time.monotonic() + 300
    # iteration 1's agents: the first policy is trained and an agents' process of this run is up
    while time.monotonic() < deadline and process.poll() is None:
        trained = faulted.exists() and len(Store(faulted).versions("policy")) >= 2
        running = agent_processes(process.pid)
        if trained and running:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before its second iteration's agents ran"
    time.sleep(0.3)  # into the agents' calls
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(1.0)
    assert not running & agent_processes(), "the agents' process outlived mtrl"
    assert len(Store(faulted).versions("policy")) < 4  # killed before the end: imported + 3 iterations

    assert start(faulted, prefect_server_env).wait(timeout=600) == 0
    # Every byte: the calls met other calls in other batches (timing), but the engine's numbers while it
    # serves agents do not depend on a row's batch (hf.py, serve), and sampling is seeded per call.
    assert main(["diff", str(reference), str(faulted)]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
