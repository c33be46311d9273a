"""The same agent command twice, once on a quiet machine and once while bursty CPU hogs keep every
core busy whenever its agents call, the second run SIGKILLed while they call (in its second
iteration, after a policy was trained) and then run again under the hogs: the load moves the agents'
calls in time, so they meet in other batches (other row counts, other cache widths, other calls
joining mid-decode), and the resumed run stores the bytes of the uninterrupted one (`mtrl diff`: 0
different); the agents' process dies with mtrl. The agent is three kinds at once
(tests/agent_programs.py:three_kinds): the openai client's tool loop, a sync agent streaming every
reply, and an agent whose second call starts a new segment, so that their calls meet in the same
batches. Slow: about a minute on 2 cores.

bench/agent_determinism.py runs `kill_and_resume_under_load` at 256 rollouts for each kind alone, under
one hog per core and one more."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.main import main
from pipeline.store.versions import Store
from runtime.threads import THREAD_VARIABLES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# A busy loop in bursts of 5-200 ms with pauses of up to 100 ms (about 2/3 of a core each): it moves the calls
# in time more than a steady loop does (measured on the rules before: two runs under steady loops on both cores
# were equal, under bursts 49 of 110 rows differed). Until 2026-11-29 the burst's length was drawn anew at
# every check of the clock, which ended bursts after a few ms: each hog took about a tenth of a core.
HOG = """
import random, time
draw = random.Random({seed})
while True:
    burst, start = draw.uniform(0.005, 0.2), time.monotonic()
    while time.monotonic() - start < burst:
        pass
    time.sleep(draw.uniform(0, 0.1))
"""


@contextlib.contextmanager
def cpu_hogs(count: int, busy_while: Callable[[], bool]) -> Iterator[dict[str, float]]:
    """`count` bursty busy loops that run while `busy_while()` is true (asked every 50 ms) and are
    stopped (SIGSTOP) while it is false. Yields {"busy_s": the seconds they ran so far}."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(seed=seed)]) for seed in range(count)]
    load, done = {"busy_s": 0.0}, threading.Event()

    def follow() -> None:
        running, since = True, time.monotonic()
        while not done.wait(0.05):
            if running:
                load["busy_s"] += time.monotonic() - since
            since = time.monotonic()
            if busy_while() != running:
                running = not running
                for hog in hogs:
                    hog.send_signal(signal.SIGCONT if running else signal.SIGSTOP)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        yield load
    finally:
        done.set()
        follower.join()
        for hog in hogs:
            hog.kill()
            hog.wait()


def agent_processes(parent: int) -> set[int]:
    """The agents' processes that `parent` runs now (its children running child.py)."""
    found = set()
    for tasks in Path(f"/proc/{parent}/task").glob("*/children"):
        try:
            children = tasks.read_text().split()
        except OSError:  # the parent or that thread ended
            continue
        for child in children:
            try:
                if b"generate_rollouts/agents/child.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    """Is this process running (a zombie, dead but not yet reaped, is not)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_and_resume_under_load(
    function: str, rollouts: int, root: Path, env: dict[str, str], hogs: int
) -> dict[str, Any]:
    """`mtrl run --agent function` for 2 iterations into root/uninterrupted; then, under `hogs` cpu_hogs, the same
    into root/resumed, SIGKILLed (its whole process group) once its second iteration's agents run, and run
    again to the end. Returns what happened: walls, the policies written before the kill, the agents'
    processes left 5 s after it, and the rows of the uninterrupted run."""
    command = ["--agent", function, "--rollouts", str(rollouts), "--iterations", "2"]
    # mtrl's own thread count (every core), as a user runs it, not the one thread the tests give processes
    env = {name: value for name, value in env.items() if name not in THREAD_VARIABLES}

    def start(runs_dir: Path) -> subprocess.Popen:
        run = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *command]
        with open(runs_dir.parent / f"{runs_dir.name}.out", "ab") as output:  # the child keeps its own copy
            return subprocess.Popen(run, env=env, cwd=ROOT, stdout=output, stderr=output, start_new_session=True)

    uninterrupted, resumed = root / "uninterrupted", root / "resumed"
    report: dict[str, Any] = {"agent": function, "rollouts": rollouts}
    started = time.monotonic()
    assert start(uninterrupted).wait(timeout=1800) == 0, (root / "uninterrupted.out").read_text()[-3000:]
    report["uninterrupted_s"] = round(time.monotonic() - started, 1)
    # The hogs run while the run's agents call, where the load moves calls between batches; the imports,
    # the Prefect server's start and the updates, which the load cannot change, are left to run on their own.
    run: list[subprocess.Popen] = []
    with cpu_hogs(hogs, busy_while=lambda: bool(run and agent_processes(run[-1].pid))) as load:
        started = time.monotonic()
        process = start(resumed)
        run.append(process)
        deadline, agents = time.monotonic() + 1800, set()
        while time.monotonic() < deadline and process.poll() is None:
            trained = resumed.exists() and len(Store(resumed).versions("policy")) >= 2  # imported + iteration 0
            if trained and (agents := agent_processes(process.pid)):
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before its second iteration's agents ran"
        time.sleep(0.3)  # into the agents' calls
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        report["killed_after_s"] = round(time.monotonic() - started, 1)
        report["policies_at_kill"] = len(Store(resumed).versions("policy"))
        settle = time.monotonic() + 5  # the kernel's SIGKILL reaches the agents' process when it is scheduled
        while any(alive(pid) for pid in agents) and time.monotonic() < settle:
            time.sleep(0.05)
        report["agents_processes_left"] = sum(alive(pid) for pid in agents)

        started = time.monotonic()
        run.append(start(resumed))
        assert run[-1].wait(timeout=1800) == 0, (root / "resumed.out").read_text()[-3000:]
        report["resume_s"] = round(time.monotonic() - started, 1)
        report["hogs_busy_s"] = round(load["busy_s"], 1)

    store = Store(uninterrupted)
    turns = [store.load("generate-rollouts", manifest.version) for manifest in store.versions("generate-rollouts")]
    report["rows"] = [row for turn in turns for row in turn.select_columns(["turn", "failed"])]
    return report


def test_an_agent_run_killed_under_load_resumes_to_the_bytes_of_the_uninterrupted_run(
    tmp_path, prefect_server_env, capsys
):
    # 32 rollouts (11, 11 and 10 of the three kinds; the bench runs 256 of each), beside one hog per core (the
    # bench adds one more: here the other pytest worker's tests keep the machine busy too)
    hogs = os.cpu_count() or 1
    report = kill_and_resume_under_load("tests.agent_programs:three_kinds", 32, tmp_path, prefect_server_env, hogs)
    with capsys.disabled():  # the walls and the hogs' busy seconds, on the console (capsys reads the diff's output)
        print({key: value for key, value in report.items() if key != "rows"})
    assert report["hogs_busy_s"] > 0, "the hogs never ran beside the agents"
    assert report["policies_at_kill"] < 3  # killed before the end: imported + 2 iterations
    assert report["agents_processes_left"] == 0, "the agents' process outlived mtrl"
    rows = report["rows"]
    assert rows and not any(row["failed"] for row in rows)  # the agents ran: none failed
    assert any(row["turn"] > 0 for row in rows)  # and called again: calls joined the batch mid-decode
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "uninterrupted"), str(tmp_path / "resumed")]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
