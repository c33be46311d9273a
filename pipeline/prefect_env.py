"""Prefect settings mtrl needs, applied before `import prefect`.

Defaults only (a user's own environment wins): telemetry off, PREFECT_HOME inside the runs
directory instead of ~/.prefect, a startup timeout that survives a first migration on a
slow machine, and no warnings from stage functions called outside a flow.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def prefect_home(runs_dir: str | Path) -> Path:
    return Path(runs_dir).resolve() / ".prefect"


def configure(runs_dir: str | Path) -> None:
    home = prefect_home(runs_dir)
    defaults = {
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "PREFECT_UI_ENABLED": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Stages log their own one-line summaries; per-save progress bars are noise.
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # the libraries read their variables at import, which may have happened already
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def starting_alone(home: str | Path) -> Iterator[None]:
    """Hold while a Prefect server starts on the database in `home`. Servers that start together
    on a new database all run its migrations, and all but one fail ("database is locked": two
    `mtrl run` on a new runs directory); Prefect restarts its temporary server on another port,
    after a traceback. One start at a time per home: the next server finds the database ready."""
    Path(home).mkdir(parents=True, exist_ok=True)
    with open(Path(home) / ".server-start.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


@contextlib.contextmanager
def local_server(home: str | Path, timeout_s: float = 180) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1 (a free port) with its own PREFECT_HOME, for
    processes that cannot share an ephemeral server (Ray workers, deployments). Yields the API
    URL and stops the server on exit."""
    environment = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    environment.pop("PREFECT_API_URL", None)
    with starting_alone(home):
        port = free_port()  # after the wait, so that the port is still free
        server_args = ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
        url = f"http://127.0.0.1:{port}/api"
        with open(Path(home) / "server.log", "ab") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "prefect", *server_args],
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the Prefect server did not start; see {Path(home) / 'server.log'}")
            time.sleep(0.5)
    try:
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/health", timeout=2).read() == b"true"
    except OSError:
        return False


def configure_api(runs_dir: str | Path, runner_kind: str) -> bool:
    """configure(), then the API this process reports to: PREFECT_API_URL when it is set, else a
    local server for the Ray runner (Ray workers are other processes and must all report to one
    API), else Prefect's temporary server, started now and alone (see starting_alone).
    Returns whether that API is this process's own, stopped when it exits."""
    configure(runs_dir)
    if os.environ.get("PREFECT_API_URL"):
        return False
    if runner_kind != "ray":
        from prefect import get_client  # (importing prefect also sets up its logging)

        with starting_alone(os.environ["PREFECT_HOME"]), get_client(sync_client=True):
            pass  # get_client started the temporary server, which the flows then use
        return True
    # Stopped at exit, after Prefect's own exit hooks have sent the last logs (hooks run in
    # reverse order of registration, and this one is registered before Prefect starts).
    server = contextlib.ExitStack()
    url = server.enter_context(local_server(prefect_home(runs_dir) / "server"))
    atexit.register(server.close)
    print(f"started a Prefect server for the Ray workers at {url} (PREFECT_API_URL)", file=sys.stderr)
    os.environ["PREFECT_API_URL"] = url
    return True


@contextlib.contextmanager
def flow_heartbeats(enabled: bool) -> Iterator[None]:
    """Flow-run heartbeats on or off for the flow runs started inside.

    A heartbeat lets a Prefect server that outlives the process (zombie detection, an
    automation on its server) mark a run Crashed when its process dies without a word. It costs
    every flow run up to 1 s at its end: Prefect joins the heartbeat thread, which sleeps in 1 s
    steps. So mtrl turns it off where nothing can read it: on an API this process started and
    stops at exit (Prefect's temporary server, the Ray runner's local server), and for the
    iterations inside an rl-training run, whose own heartbeat covers the process they run in.
    A crash still shows: the iterations' stage tasks stay un-Completed, the store keeps no half
    version (atomic writes) and the next run redoes only what is missing."""
    if enabled:
        yield
        return
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):  # the env var cannot say None
        yield
