"""Runs of `mtrl run` on one store at the same time, as a user starts them (each with Prefect's
temporary server on the runs directory's database)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
# no PREFECT_API_URL and no PREFECT_HOME: a run starts a temporary server on RUNS_DIR/.prefect
USER_ENVIRONMENT = {
    name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "PREFECT_HOME")
}


START_API = """
import sys
from pipeline import prefect_env
prefect_env.configure(sys.argv[1])
from prefect import get_client
print("imported", file=sys.stderr, flush=True)
prefect_env.configure_api(sys.argv[1], "thread")  # what `mtrl run` does before its flows
with get_client(sync_client=True) as client:  # what a flow does first: start a server if there is none
    assert client.api_healthcheck() is None
"""


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
        time.sleep(3)  # ample time to start a server (without waiting, it says so at once)
        assert "Starting temporary server" not in log.read_text()
        assert process.poll() is None
    assert process.wait(timeout=120) == 0, log.read_text()[-6000:]  # the lock is free: it starts now
    assert "Starting temporary server" in log.read_text() and "Traceback" not in log.read_text()
