"""SIGKILL `mtrl run --agent ...` while its agents run, then run the same command again: it resumes to
the data of a run never interrupted (every token; logprobs to the last bits), and the agents' process
dies with mtrl. Slow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

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


def test_sigkill_while_agents_run_then_the_same_command_resumes_to_the_uninterrupted_data(tmp_path, prefect_server_env):
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
    # Every token, tool call, observation and stop is the uninterrupted run's. The logprobs may differ in
    # the last bits where the calls were batched otherwise (the hf engine is not batch-invariant: ~1e-6;
    # on a quiet machine the batches, and so `mtrl diff`, come out the same; under load not always).
    for stage in ("generate-rollouts", "execute-tools", "assign-rewards"):
        mine, theirs = by_position(faulted, stage), by_position(reference, stage)
        assert mine.keys() == theirs.keys()
        for key, rows in mine.items():
            for column in rows.column_names:
                if column not in ("policy_version", "completion_logprobs"):
                    assert rows[column] == theirs[key][column], (stage, key, column)
            pairs = zip(rows["completion_logprobs"], theirs[key]["completion_logprobs"])
            assert max((abs(a - b) for x, y in pairs for a, b in zip(x, y)), default=0.0) < 1e-4


def by_position(runs_dir: Path, stage: str) -> dict:
    """A stage's datasets by (iteration, turn), as `mtrl diff` matches them."""
    found = {}
    for manifest in Store(runs_dir).versions(stage):
        rows = datasets.load_from_disk(str(Store(runs_dir).path(stage, manifest.version)))
        found[rows[0]["iteration"], manifest.turn] = rows
    return found
