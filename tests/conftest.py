"""Shared fixtures. Prefect settings are applied before anything imports prefect."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from _pytest import logging as _pytest_logging

# Two pytest workers share the machine's cores (`make test`): one thread each, and so for every
# process a test starts (mtrl's default would give each run every core: runtime/threads.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="mtrl-test-prefect-"))
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)  # each pytest process's own
os.environ.setdefault("PREFECT_HOME", str(_PREFECT_HOME))
from pipeline.prefect_plumbing import servers as prefect_servers  # noqa: E402
from pipeline.prefect_plumbing import settings as prefect_settings  # noqa: E402

prefect_settings.configure(_PREFECT_HOME)  # telemetry off, no progress bars, no ~/.prefect


def _under_logging_lock(enter):
    def locked(self):
        with logging._lock:  # the lock logging.getLogger holds while it adds a logger
            return enter(self)

    return locked


# pytest 9.2's log capture, at each phase of each test, walks logging's dict of loggers without logging's
# lock (_pytest.logging.catching_logs.__enter__): a thread an earlier test left running (a Prefect API
# worker, a server's thread) that made its first logger meanwhile failed a random test's setup with
# "dictionary changed size during iteration" (tests/test_harness.py).
_pytest_logging.catching_logs.__enter__ = _under_logging_lock(_pytest_logging.catching_logs.__enter__)

# `make test` runs the tests on two processes (pytest-xdist), each test wherever a worker is free,
# except the modules below, whose tests stay on one worker: they share a costly module fixture (a
# vLLM server, a Ray cluster, an uninterrupted reference run, two played iterations, a tracked run, the audited
# run: made once, not once per worker), or
# they look at every process of the machine (an MCP server a run left over), where another
# worker's processes must not show. xdist hands out the scopes with the most tests first (its
# --loadscope-reorder, on by default), so these modules go first; among scopes of one size (the single
# tests of every other module) FIRST's order holds, so the longest single tests start next.
ONE_WORKER_MODULES = (
    "test_vllm",
    "test_distributed",
    "test_resume",
    "test_mcp",
    "test_turn_state",
    "test_tracking",
    "test_audit",
)


# Modules that share a session fixture: one scope, so that one worker makes it once (openai_loop_run).
SHARED_SCOPES = {"test_agent_process": "openai_loop_run", "test_agent_ray": "openai_loop_run"}
# Modules of long tests that may run on either worker: the first of the single-test scopes.
LONG_TESTS = ("test_vllm_runs", "test_agent_determinism")
FIRST = (*ONE_WORKER_MODULES[:2], *LONG_TESTS, *ONE_WORKER_MODULES[2:], *SHARED_SCOPES)


def pytest_collection_modifyitems(items):
    def first(item):
        module = item.module.__name__.rpartition(".")[2]
        return FIRST.index(module) if module in FIRST else len(FIRST)

    items.sort(key=first)  # stable: each module keeps its own order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        """A scope of one test each, except each module of ONE_WORKER_MODULES (one scope) and the modules
        of SHARED_SCOPES (one scope for each name)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            module = Path(path).stem
            if module in SHARED_SCOPES:
                return SHARED_SCOPES[module]
            return path if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(scope="session")
def prefect_server(prefect_server_env):
    """One Prefect API for the whole session, this process's flows included (a server costs ~8 s to
    start): the real server of prefect_server_env, with flow heartbeats off (they add a 1 s floor
    to every flow run)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    settings = {PREFECT_API_URL: prefect_server_env["PREFECT_API_URL"], PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    with temporary_settings(settings):
        yield
        # the last logs and events reach the server before it stops (as prefect_test_harness does)
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all()
        EventsWorker.drain_all()


@pytest.fixture(scope="session")
def tiny():
    """The embedded policy: (model, tokenizer), fp32 on CPU."""
    from pipeline.models.base_model import EMBEDDED_POLICY
    from stages.policy.loading import load_model, load_tokenizer

    return load_model(EMBEDDED_POLICY, "float32", "cpu"), load_tokenizer(EMBEDDED_POLICY)


@pytest.fixture
def small_config(tmp_path):
    """A run small enough for a test: 2 tasks x 4 samples, up to 3 turns."""
    from schemas.config import RunConfig

    return RunConfig(
        iterations=1,
        task={"rollouts": 8, "group_size": 4, "max_turns": 3},
        generation={"max_new_tokens": 64},
        ppo={"minibatch_rollouts": 4},
        store={"runs_dir": tmp_path / "runs"},
    )


# Under `-n`, one Prefect server serves both workers (a server costs ~8 s of CPU to start and keeps
# polling while idle): the controller starts it while the workers start, and tells them where its URL
# will be (SHARED_SERVER, inherited by the workers); without workers, the session starts its own.
SHARED_SERVER = "MTRL_TEST_PREFECT_SERVER_URL_FILE"
_SHARED_SERVER_STOP = pytest.StashKey[tuple]()  # the controller's (stop event, serving thread)


def pytest_configure(config):
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # a worker, or a run without workers
    home = Path(tempfile.mkdtemp(prefix="mtrl-test-prefect-server-"))
    os.environ[SHARED_SERVER] = str(home / "url")
    stop = threading.Event()

    def serve() -> None:
        # The kernel stops the server when the thread that started it ends (servers.py): this thread
        # lives until the session ends.
        try:
            with prefect_servers.local_server(home) as url:
                (home / "url.tmp").write_text(url)
                (home / "url.tmp").rename(home / "url")
                stop.wait()
        except BaseException as exc:
            (home / "error").write_text(f"{type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(home, ignore_errors=True)

    thread = threading.Thread(target=serve, name="shared-prefect-server", daemon=True)
    thread.start()
    config.stash[_SHARED_SERVER_STOP] = (stop, thread)


def pytest_sessionfinish(session):
    # A flow run in a test process without PREFECT_API_URL starts Prefect's temporary server, which
    # Prefect stops at exit and logs it to the stream pytest had given it, closed by then ("--- Logging
    # error --- ValueError: I/O operation on closed file" after the summary): stop it while streams are open,
    # without its "Stopping temporary server" line among the progress dots.
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        prefect_logger = logging.getLogger("prefect")
        level = prefect_logger.level
        prefect_logger.setLevel(logging.WARNING)
        try:
            for temporary in list(server.SubprocessASGIServer._instances.values()):
                temporary.stop()
        finally:
            prefect_logger.setLevel(level)


def pytest_unconfigure(config):
    if _SHARED_SERVER_STOP in config.stash:
        stop, thread = config.stash[_SHARED_SERVER_STOP]
        stop.set()
        thread.join(timeout=60)


def shared_server_url(url_file: Path, timeout_s: float = 300) -> str:
    """The URL of the controller's server, once it is up."""
    deadline = time.monotonic() + timeout_s
    while not url_file.exists():
        if (url_file.parent / "error").exists():
            pytest.fail(f"the shared Prefect server did not start: {(url_file.parent / 'error').read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"the shared Prefect server did not start within {timeout_s:g} s")
        time.sleep(0.1)
    return url_file.read_text()


@pytest.fixture(scope="session")
def prefect_server_env(tmp_path_factory):
    """A real `prefect server start` on 127.0.0.1 with its own PREFECT_HOME (under `-n`, the one the
    workers share); yields the environment for client processes (PREFECT_API_URL set)."""
    if shared := os.environ.get(SHARED_SERVER):
        home, server = Path(shared).parent, contextlib.nullcontext(shared_server_url(Path(shared)))
    else:
        home = tmp_path_factory.mktemp("prefect-home")
        server = prefect_servers.local_server(home)
    with server as url:
        yield {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}


OPENAI_LOOP_ARGS = "--iterations 2 --rollouts 8 --group-size 4 --agent examples.agents.openai_loop:agent".split()


@pytest.fixture(scope="session")
def openai_loop_run(tmp_path_factory, prefect_server_env):
    """`mtrl run` of examples/agents/openai_loop.py in mtrl's environment (OPENAI_LOOP_ARGS): the bytes the
    same agent in another environment (test_agent_process) and on Ray (test_agent_ray) must give. Returns
    (runs dir, the run's arguments)."""
    runs_dir = tmp_path_factory.mktemp("openai-loop") / "runs"
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *OPENAI_LOOP_ARGS]
    done = subprocess.run(
        command, cwd=Path(__file__).parents[1], env=prefect_server_env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return runs_dir, list(OPENAI_LOOP_ARGS)
