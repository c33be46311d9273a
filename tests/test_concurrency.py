"""Runs of `mtrl run` on one store at the same time, as a user starts them (each with Prefect's
temporary server on the runs directory's database): every run succeeds, and no version is lost,
mixed into the other run's lineage or written twice (slow: about a minute)."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store.lineage import run_config
from pipeline.store.versions import Store

pytestmark = pytest.mark.slow
ARGS = ["--iterations", "2", "--task", "calculator", "--rollouts", "2", "--group-size", "2", "--max-turns", "1"]
ARGS += ["--set", "generation.max_new_tokens=8"]
# no PREFECT_API_URL and no PREFECT_HOME: each run starts a temporary server on RUNS_DIR/.prefect
USER_ENVIRONMENT = {
    name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "PREFECT_HOME")
}


def start(runs_dir: Path, seed: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), "--seed", str(seed), *ARGS]
    return subprocess.Popen(command, env=USER_ENVIRONMENT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_policy(run: subprocess.Popen) -> str:
    """Waits for a run; the policy version it reports last."""
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out[-3000:] + err[-6000:]
    assert "Traceback" not in err, err[-6000:]  # nothing failed on the way, not even something retried
    return Path(re.findall(r"^\s+policy\s+(\S+)$", out, re.MULTILINE)[-1]).name


def stored_versions(runs_dir: Path) -> dict[str, str]:
    """stage/version -> when it was written; and no temporary folder left behind."""
    assert list(runs_dir.rglob(".tmp-*")) == []
    return {f"{m.stage}/{m.version}": m.created_at for m in Store(runs_dir).versions()}


def test_runs_started_together_on_one_store_keep_their_versions_apart(tmp_path):
    runs = tmp_path / "runs"
    started = time.monotonic()
    # seeds 1 and 2 write different versions; the second run of seed 1 must find the first's
    runs_started = [start(runs, seed=1), start(runs, seed=2), start(runs, seed=1)]
    policies = [final_policy(run) for run in runs_started]
    print(f"three runs at once: {time.monotonic() - started:.0f} s")
    assert policies[2] == policies[0] != policies[1]

    store = Store(runs)
    for manifest in store.versions():
        assert store.verify(manifest.stage, manifest.version) == [], f"{manifest.stage}/{manifest.version}"
    for policy in store.versions("policy"):
        store.policy_dir(policy.version)  # checks the digests of an imported starting model too
    lineages, writers = {}, {}
    for seed, policy in ((1, policies[0]), (2, policies[1])):
        lineage = store.lineage("policy", policy)
        lineages[seed] = {f"{m.stage}/{m.version}" for m in lineage}
        writers[seed] = {m.extra("process")["pid"] for m in lineage if m.extra("process")}  # datasets record it
        for manifest in lineage:
            if manifest.stage == "policy" and not manifest.parents:
                continue  # the imported starting model: the one version both runs share
            # a trained policy is named by the version that wrote it, whose manifest records the run config
            ((stage, version),) = (
                manifest.parents.items() if manifest.stage == "policy" else [(manifest.stage, manifest.version)]
            )
            recorded = run_config(store, stage, version)
            assert recorded["seed"] == seed, f"{manifest.stage}/{manifest.version} in the lineage of seed {seed}"
    assert writers[1] <= {runs_started[0].pid, runs_started[2].pid} and writers[2] == {runs_started[1].pid}
    (starting_model,) = lineages[1] & lineages[2]
    assert starting_model.startswith("policy/")
    stored = stored_versions(runs)
    assert set(stored) == lineages[1] | lineages[2]

    for seed in (1, 2):  # alone, each run finds all of its versions: nothing is written again
        final_policy(start(runs, seed))
        assert stored_versions(runs) == stored


START_API = """
import sys
from pipeline.prefect_plumbing import servers as prefect_servers
from pipeline.prefect_plumbing import settings as prefect_settings
prefect_settings.configure(sys.argv[1])
from prefect import get_client
print("imported", file=sys.stderr, flush=True)
prefect_servers.start_api(sys.argv[1], "thread")()  # what `mtrl run` does before its flows
with get_client(sync_client=True) as client:  # what a flow does first: start a server if there is none
    assert client.api_healthcheck() is None
"""


def waits_for_lock(pid: int, inode: int) -> bool:
    """Whether process PID is blocked on a flock of the file INODE (Linux lists waiters in /proc/locks
    after "->": "1: -> FLOCK ADVISORY WRITE PID MAJOR:MINOR:INODE 0 EOF")."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 1] == "FLOCK":
            owner, device = fields[fields.index("->") + 4], fields[fields.index("->") + 5]
            if owner == str(pid) and device.rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def test_a_run_starts_its_prefect_server_only_while_no_other_is_starting_on_its_database(tmp_path):
    """Temporary servers that start at once on a new database all run its migrations and all but
    one fail ("database is locked"; Prefect restarts them after a traceback): one at a time."""
    runs, log = tmp_path / "runs", tmp_path / "stderr.log"
    (runs / ".prefect").mkdir(parents=True)
    with open(runs / ".prefect" / ".server-start.lock", "w") as lock, log.open("w") as stderr:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a run whose server is starting holds it
        process = subprocess.Popen([sys.executable, "-c", START_API, str(runs)], env=USER_ENVIRONMENT, stderr=stderr)
        deadline = time.monotonic() + 120
        while "imported" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "imported" in log.read_text(), log.read_text()[-6000:]
        inode = os.fstat(lock.fileno()).st_ino
        while not waits_for_lock(process.pid, inode) and time.monotonic() < deadline:
            if process.poll() is not None or "Starting temporary server" in log.read_text():
                break  # it did not wait
            time.sleep(0.05)
        assert waits_for_lock(process.pid, inode)  # blocked on the lock the test holds
        assert "Starting temporary server" not in log.read_text()
        assert process.poll() is None
    assert process.wait(timeout=120) == 0, log.read_text()[-6000:]  # the lock is free: it starts now
    assert "Starting temporary server" in log.read_text() and "Traceback" not in log.read_text()


def run_script(script: str, *arguments: str, timeout: float) -> str:
    """Run `python -c SCRIPT ARGUMENTS...` in a user's environment; its output (it must succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *arguments],
        env=USER_ENVIRONMENT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


START_WHILE_IMPORTING = """
import os, sys
forks = []
os.register_at_fork(before=lambda: forks.append("before"), after_in_parent=lambda: forks.append("after"))
from pipeline.prefect_plumbing import servers as prefect_servers
wait = prefect_servers.start_api(sys.argv[1], "thread")
wait()
print(forks)
"""


def test_the_temporary_server_starts_without_pythons_fork_hooks(tmp_path):
    """mtrl's main thread imports while another thread starts the server. A fork that runs
    Python's at-fork hooks races with a first `import logging` (it registers a before/after
    pair): the hook registered between the two ran only its half, and the run printed a
    "cannot release un-acquired lock" traceback (seen once in three concurrent runs). The
    server is started without them (no preexec_fn); it asks for its parent-death signal itself."""
    assert run_script(START_WHILE_IMPORTING, str(tmp_path / "runs"), timeout=120).strip() == "[]"


def test_a_sigkilled_run_takes_its_temporary_prefect_server_along(tmp_path):
    """The server mtrl starts for itself is stopped at exit; a SIGKILLed mtrl runs no exit hook,
    so the kernel sends the server SIGTERM when mtrl's thread that started it ends."""
    import psutil

    run = start(tmp_path / "runs", seed=1)
    servers: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while not servers and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
        children = psutil.Process(run.pid).children()
        servers = [child for child in children if "prefect.server.api.server:create_app" in " ".join(child.cmdline())]
    assert servers, "mtrl started no temporary Prefect server"
    run.kill()
    run.communicate()
    gone, alive = psutil.wait_procs(servers, timeout=20)
    assert not alive, f"the Prefect server {alive[0].pid} outlived the SIGKILLed mtrl"


CONCURRENT_WRITES = """
import json, os, sys, threading
import httpx
from pipeline.prefect_plumbing import servers as prefect_servers

if sys.argv[1].startswith("http"):  # a server already started
    url = sys.argv[1]
else:  # the temporary server of a runs directory
    prefect_servers.start_api(sys.argv[1], "thread")()
    url = os.environ["PREFECT_API_URL"]
with httpx.Client(base_url=url) as client:
    flow = client.post("/flows/", json={"name": "writers"}).json()
    flow_run = client.post("/flow_runs/", json={"flow_id": flow["id"], "name": "writers"}).json()
statuses = []

def write(writer):  # task runs and artifacts, as a flow and mtrl's artifact thread write them
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(20):
            if i % 2:
                task_run = {"flow_run_id": flow_run["id"], "task_key": f"t{writer}", "dynamic_key": str(i), "name": "t"}
                statuses.append(client.post("/task_runs/", json=task_run).status_code)
            else:
                artifact = {"key": f"a{writer % 2}", "type": "markdown", "data": "x", "flow_run_id": flow_run["id"]}
                statuses.append(client.post("/artifacts/", json=artifact).status_code)

writers = [threading.Thread(target=write, args=(writer,)) for writer in range(8)]
for writer in writers:
    writer.start()
for writer in writers:
    writer.join()
print(json.dumps(statuses))
"""


@pytest.mark.parametrize("server", ["temporary", "prefect server start"])
def test_mtrls_prefect_servers_take_concurrent_writes_without_refusing_any(server, tmp_path, request):
    """Eight writers at once (task runs and artifacts, without the client's retries): Prefect's
    server as it comes answered about half of them 503 "database is locked" (SQLite refuses a
    deferred transaction's write at once when another connection wrote since it read), which
    Prefect's client retries after 2 s: in `mtrl run` an iteration stalled 1.8-2.5 s about one
    run in three. Both servers mtrl starts (its temporary one, and the `prefect server start` of
    Ray runs, which the tests' deployments also use) begin every transaction with the write lock."""
    import json

    target = str(tmp_path / "runs")
    if server == "prefect server start":
        target = request.getfixturevalue("prefect_server_env")["PREFECT_API_URL"]
    statuses = json.loads(run_script(CONCURRENT_WRITES, target, timeout=180).strip().splitlines()[-1])
    assert len(statuses) == 160 and set(statuses) == {201}, sorted(set(statuses))
