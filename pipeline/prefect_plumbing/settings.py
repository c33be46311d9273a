"""Prefect settings mtrl needs, applied before `import prefect` (configure), and the one it
changes while flows run (flow_heartbeats).

Defaults only (a user's own environment wins): telemetry off, PREFECT_HOME inside the runs
directory instead of ~/.prefect, a startup timeout that survives a first migration on a
slow machine, no warnings from stage functions called outside a flow, and no progress bars
from the libraries (the stages log their own one-line summaries).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def prefect_home(runs_dir: str | Path) -> Path:
    return Path(runs_dir).resolve() / ".prefect"


def configure(runs_dir: str | Path) -> None:
    """The environment defaults for a run on `runs_dir`; imports nothing heavy."""
    defaults = {
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(prefect_home(runs_dir)),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "PREFECT_UI_ENABLED": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # read by datasets and transformers when they are imported
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # a library imported before this (a notebook, a test) read its variable already
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


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
