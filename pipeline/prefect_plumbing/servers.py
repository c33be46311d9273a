"""The Prefect API servers mtrl starts for itself, each a child process that never outlives it
(runtime/processes.py), run through pipeline/prefect_plumbing/api_server.py:

- start_api: the API a run reports to: PREFECT_API_URL when set; else, for the Ray runner, a
  local `prefect server start` (local_server: Ray workers are other processes and must all
  report to one API); else a temporary server like Prefect's own, started in the background
  at once, so that its start overlaps mtrl's imports and checks;
- a migrated empty database kept once per machine and Prefect version, copied into a new runs
  directory instead of migrating again (use_database_template).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.prefect_plumbing import patches as prefect_patches
from pipeline.prefect_plumbing.settings import configure, prefect_home
from runtime.cache import cache_dir
from runtime.processes import dies_with_this_thread, free_port


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


def launched(*module_and_args: str) -> list[str]:
    """`python -m MODULE ARGS...` as mtrl's server launcher runs it (pipeline/prefect_plumbing/api_server.py:
    it imports without garbage collection, and its SQLite transactions wait for the lock)."""
    return [sys.executable, "-m", "pipeline.prefect_plumbing.api_server", *module_and_args]


def _start_server(
    home: Path, command: list[str], port: int, timeout_s: float, environment: dict[str, str]
) -> subprocess.Popen:
    """Start a Prefect API server process on 127.0.0.1:`port` (its output in home/server.log),
    one start at a time per home, and wait until it answers. `command` is `launched`; the server
    stops when the calling thread ends (a SIGKILLed mtrl too: dies_with_this_thread)."""
    environment = {**environment, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    url = f"http://127.0.0.1:{port}/api"
    with starting_alone(home):
        with open(home / "server.log", "ab") as log:
            server = subprocess.Popen(
                dies_with_this_thread(command),
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches mtrl, which stops the server after its last logs
            )
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the Prefect server did not start; see {home / 'server.log'}")
            time.sleep(0.1)
        # The API's first request builds its routes (~0.4 s on 2 cores): made here, while the
        # caller is still importing, instead of by the first flow run (Prefect's version check).
        urllib.request.urlopen(f"{url}/admin/version", timeout=timeout_s).read()
    return server


def _start_on_template(
    home: Path, command: list[str], port: int, timeout_s: float, environment: dict[str, str]
) -> subprocess.Popen:
    """_start_server on `home`'s database, copied from the kept template when it has none (and
    kept as the template when there was none yet)."""
    database = use_database_template(home)
    # the template is migrated for this Prefect version: its check (alembic) costs ~0.2 s
    migrate = {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false"} if database == "copied" else {}
    server = _start_server(home, command, port, timeout_s, {**environment, **migrate})
    if database == "new":
        save_database_template(home)
    return server


def _stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


@contextlib.contextmanager
def local_server(home: str | Path, timeout_s: float = 180) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1 (a free port) with its own PREFECT_HOME, for
    processes that cannot share an ephemeral server (Ray workers, deployments), `launched`.
    Yields the API URL and stops the server on exit."""
    home, port = Path(home), free_port()
    command = launched("prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui")
    environment = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    home.mkdir(parents=True, exist_ok=True)
    server = _start_on_template(home, command, port, timeout_s, environment)
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        _stop_server(server)


def _healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/health", timeout=2).read() == b"true"
    except OSError:
        return False


# A new runs directory gets a new Prefect database, and its first server spends ~3 s (2 cores)
# running every migration and registering the block types. The result is the same for every
# new database of one Prefect version: it is kept once per machine (a cache: safe to delete)
# and copied into the next new PREFECT_HOME. A database that exists is never replaced.
DATABASE, MEMO_STORE = prefect_patches.DATABASE_FILES  # the database; the memo of registered block types


def database_template_dir() -> Path | None:
    """Where the migrated empty database of this Prefect version is kept; None when the user
    set their own database."""
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get(
        "PREFECT_SERVER_DATABASE_CONNECTION_URL"
    ):
        return None
    from importlib import metadata

    return cache_dir() / f"prefect-{metadata.version('prefect')}-database"


def use_database_template(home: Path) -> str:
    """Copy the kept migrated database into `home` when it has none. Returns what `home` has
    now: "copied" (the template: migrated for this Prefect version), "new" (no database and no
    template: its first server migrates it, save it after) or "existing" (a database of an
    earlier run, perhaps of another Prefect version)."""
    template = database_template_dir()
    if template is None or (home / DATABASE).exists():
        return "existing"
    if not (template / DATABASE).is_file():
        return "new"
    with starting_alone(home):  # two runs on one new runs directory: one copies, the other finds it
        if (home / DATABASE).exists():
            return "existing"
        for name in prefect_patches.DATABASE_FILES:
            if (template / name).is_file():
                partial = home / f".{name}.{os.getpid()}.tmp"
                shutil.copyfile(template / name, partial)
                os.replace(partial, home / name)  # whole or absent; the memo never without its database
    return "copied"


def save_database_template(home: Path) -> None:
    """Keep `home`'s database, just migrated by its first server and with no run in it yet, as
    the template (SQLite's online backup: a consistent copy while the server runs)."""
    template = database_template_dir()
    if template is None or (template / DATABASE).is_file():
        return
    partial = template.parent / f".{template.name}.{os.getpid()}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(home / DATABASE)) as source:
        with contextlib.closing(sqlite3.connect(partial / DATABASE)) as copy:
            source.backup(copy)
    if (home / MEMO_STORE).is_file():
        shutil.copyfile(home / MEMO_STORE, partial / MEMO_STORE)
    try:
        os.rename(partial, template)  # atomic; another process may have kept its copy first
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def start_api(runs_dir: str | Path, runner_kind: str) -> Callable[[], bool]:
    """configure(), then start the Prefect API this process reports to, and return `wait()`,
    which blocks until the API answers and says whether it is this process's own (stopped at
    exit). The API is PREFECT_API_URL when it is set; else a local `prefect server start` for
    the Ray runner (Ray workers are other processes and must all report to one API); else a
    temporary server like Prefect's own, on RUNS_DIR/.prefect's database.

    The temporary server starts at once in the background: its process (importing the server,
    checking the database) runs on another core while this one imports torch and checks the
    config, instead of before them. Its URL is fixed now, before anything imports Prefect (which
    reads PREFECT_API_URL when imported), so this process never starts Prefect's own server.
    Servers on one database start one at a time (starting_alone)."""
    configure(runs_dir)
    if os.environ.get("PREFECT_API_URL"):
        return lambda: False
    if runner_kind == "ray":
        return lambda: _start_ray_server(runs_dir)
    home = Path(os.environ["PREFECT_HOME"])
    port = free_port()
    timeout_s = float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    started: dict[str, Any] = {}
    ready, exiting = threading.Event(), threading.Event()

    def start() -> None:
        try:
            command = launched(*prefect_patches.temporary_server_arguments(port))
            started["server"] = _start_on_template(home, command, port, timeout_s, environment)
        except BaseException as exc:  # raised by wait(), in the caller's thread
            started["error"] = exc
        ready.set()
        # The kernel stops the server when the thread that started it ends (a SIGKILLed mtrl
        # included: the server calls die_with_parent), so this thread lives until the process exits.
        exiting.wait()

    starting = threading.Thread(target=start, name="prefect-api-start", daemon=True)

    def stop() -> None:  # at exit: after Prefect's own exit hooks have sent the last logs (registered later)
        ready.wait(timeout=timeout_s)
        if "server" in started:
            _stop_server(started["server"])
        exiting.set()

    atexit.register(stop)
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    # what Prefect sets for its temporary server: the app without UI, with a temporary server's services
    environment = {**os.environ, **prefect_patches.TEMPORARY_SERVER_ENVIRONMENT}
    starting.start()

    def wait() -> bool:
        ready.wait()
        if "error" in started:
            raise started["error"]
        return True

    return wait


def _start_ray_server(runs_dir: str | Path) -> bool:
    # Stopped at exit, after Prefect's own exit hooks have sent the last logs (hooks run in
    # reverse order of registration, and this one is registered before Prefect starts).
    server = contextlib.ExitStack()
    url = server.enter_context(local_server(prefect_home(runs_dir) / "server"))
    atexit.register(server.close)
    print(f"started a Prefect server for the Ray workers at {url} (PREFECT_API_URL)", file=sys.stderr)
    os.environ["PREFECT_API_URL"] = url
    return True
