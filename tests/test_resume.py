"""Kill a real `mtrl run` with SIGKILL at random moments, restart it each time, and check it ends
with exactly the versions and bytes of an uninterrupted run: the synchronous loop (3 kills), and
with ppo.max_staleness=1, where the next iteration generates while one trains (a Ctrl-C while the
next batch is made beside an update, then 2 kills); `mtrl diff` too, for both. Slow: ~2.5 minutes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli.main import main
from pipeline.store.versions import Store

pytestmark = pytest.mark.slow
# Three iterations: each restart adds a few versions before its kill (the later turns of a
# guess-number iteration take tens of milliseconds), and every kill must land before the end (with
# two iterations the last of four once landed after the last version was written).
ARGS = [
    "--iterations",
    "3",
    "--task",
    "calculator,guess-number",
    "--rollouts",
    "8",
    "--group-size",
    "4",
    "--max-turns",
    "10",
    "--set",
    "generation.max_new_tokens=48",
]


def start(runs_dir: Path, env: dict, staleness: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *ARGS]
    command += ["--set", f"ppo.max_staleness={staleness}"]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def contents(runs_dir: Path) -> dict[str, dict]:
    store = Store(runs_dir)
    for manifest in store.versions():
        assert store.verify(manifest.stage, manifest.version) == []
    return {f"{m.stage}/{m.version}": m.files for m in store.versions()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prefect_server_env):
    """uninterrupted(staleness): the runs dir of a run never interrupted (made once per module)."""
    made: dict[int, Path] = {}

    def run(staleness: int) -> Path:
        if staleness not in made:
            runs_dir = tmp_path_factory.mktemp(f"uninterrupted-{staleness}")
            assert start(runs_dir, prefect_server_env, staleness).wait(timeout=600) == 0
            made[staleness] = runs_dir
        return made[staleness]

    return run


@pytest.mark.parametrize("staleness, kill_count", [(0, 3), (1, 2)])
def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_data(
    tmp_path, prefect_server_env, uninterrupted, staleness, kill_count, capsys
):
    # One real Prefect server outlives the kills, so a restart costs its imports, not a server start.
    reference = uninterrupted(staleness)
    expected = contents(reference)

    # Each kill lands at a random moment shortly after the run has made progress (a new version
    # appeared), so that kills fall inside stages of every kind, not only during start-up.
    rng = random.Random(1234)
    faulted = tmp_path / "faulted"
    if staleness == 1:  # first a Ctrl-C while the next batch is made beside an update; the kills resume it
        interrupt_the_batch_made_ahead(faulted, prefect_server_env)
    kills = []
    while len(kills) < kill_count:
        before = len(list_versions(faulted))
        process = start(faulted, prefect_server_env, staleness)
        deadline = time.monotonic() + 300
        while process.poll() is None and len(list_versions(faulted)) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.2))
        if process.poll() is not None:
            pytest.fail(f"the run ended (code {process.returncode}) after only {len(kills)} kills")
        os.killpg(process.pid, signal.SIGKILL)  # the run and its tool workers
        process.wait()
        kills.append(len(list_versions(faulted)))
    final = start(faulted, prefect_server_env, staleness)
    assert final.wait(timeout=600) == 0
    print("versions on disk at each kill:", json.dumps(kills))
    assert kills == sorted(kills) and kills[-1] < len(expected)  # progress between kills, not finished
    assert [p for p in faulted.rglob(".tmp-*")] == []  # cleaned by the restarts (their writers are dead)
    assert contents(faulted) == expected
    assert main(["diff", str(reference), str(faulted)]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
    replays = [m.extra("replay") for m in Store(faulted).versions("generate-rollouts") if m.extra("replay")]
    assert all(r["max_abs_logprob_difference"] == 0.0 for r in replays)


def list_versions(runs_dir: Path) -> list[dict]:
    return Store(runs_dir).versions() if runs_dir.exists() else []


def interrupt_the_batch_made_ahead(runs_dir: Path, env: dict) -> None:
    """With ppo.max_staleness=1, iteration 1's batch is made while iteration 0 trains. Ctrl-C (SIGINT to
    the run's process group, as a terminal sends it) as soon as its first turn is stored: the run exits
    with an error, and the batch stops at its next turn boundary instead of running to its end."""
    process = start(runs_dir, env, 1)
    deadline = time.monotonic() + 300
    while process.poll() is None and generated_turns(runs_dir, iteration=1) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before iteration 1's batch began"
    os.killpg(process.pid, signal.SIGINT)
    turns_at_signal = generated_turns(runs_dir, iteration=1)
    assert process.wait(timeout=120) != 0
    # the turn in flight ends (one more may have begun before the signal landed); no later one starts
    assert generated_turns(runs_dir, iteration=1) <= turns_at_signal + 1
    assert not [m for m in Store(runs_dir).versions("assign-rewards") if m.iteration == 1]


def generated_turns(runs_dir: Path, iteration: int) -> int:
    """Stored generate-rollouts turns of an iteration (their manifests only: read while a run writes)."""
    turns = 0
    for manifest in (runs_dir / "generate-rollouts").glob("*/manifest.json"):
        if not manifest.parent.name.startswith("."):  # a version being written
            turns += json.loads(manifest.read_text()).get("iteration") == iteration
    return turns
