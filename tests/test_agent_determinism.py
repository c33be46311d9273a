"""The same agent command twice while CPU hogs keep every core busy: the load moves the agents' calls in
time, so they meet in other batches (other row counts, other cache widths, other calls joining
mid-decode), and the two runs store the same bytes (`mtrl diff`: 0 different). Slow: each agent's two
runs took 1.5-2.6 minutes on 2 busy cores (6 minutes for the three)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.store import Store
from runtime.threads import THREAD_VARIABLES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# A busy loop in bursts of 5-200 ms with pauses of up to 100 ms: it moves the calls in time more than a
# steady loop does (measured on the rules before: two runs under steady loops on both cores were equal, under
# these bursts 49 of 110 rows differed).
HOG = """
import random, time
draw = random.Random({seed})
while True:
    start = time.monotonic()
    while time.monotonic() - start < draw.uniform(0.005, 0.2):
        pass
    time.sleep(draw.uniform(0, 0.1))
"""


@contextlib.contextmanager
def cpu_hogs() -> Iterator[None]:
    """One bursty busy loop per core, and one more."""
    count = (os.cpu_count() or 1) + 1
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(seed=seed)]) for seed in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.parametrize(
    ("function", "rollouts"),
    [
        ("examples.agents.openai_loop:agent", 32),
        ("tests.agent_programs:streams_in_sync", 16),  # a sync agent streaming every reply
        ("tests.agent_programs:edits_history", 16),  # its second call starts a new segment
    ],
)
def test_an_agent_run_under_load_gives_the_same_bytes_twice(tmp_path, prefect_server_env, capsys, function, rollouts):
    # mtrl's own thread count (every core), as a user runs it, not the one thread the tests give processes
    env = {name: value for name, value in prefect_server_env.items() if name not in THREAD_VARIABLES}
    runs = [tmp_path / "first", tmp_path / "second"]
    command = ["--agent", function, "--rollouts", str(rollouts), "--iterations", "2"]
    with cpu_hogs():
        for runs_dir in runs:
            run = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *command]
            subprocess.run(run, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = Store(runs[0])
    turns = [store.load("generate-rollouts", manifest.version) for manifest in store.versions("generate-rollouts")]
    rows = [row for turn in turns for row in turn.select_columns(["turn", "failed"])]
    assert rows and not any(row["failed"] for row in rows)  # the agents ran: none failed
    assert any(row["turn"] > 0 for row in rows)  # and called again: calls joined the batch mid-decode
    assert main(["diff", *map(str, runs)]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
