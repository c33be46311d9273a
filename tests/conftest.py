"""Shared fixtures. Prefect settings are applied before anything imports prefect."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="mtrl-test-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_PREFECT_HOME))
from pipeline import prefect_servers, prefect_settings  # noqa: E402

prefect_settings.configure(_PREFECT_HOME)  # telemetry off, no progress bars, no ~/.prefect

import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API for the whole session (a harness costs ~10 s to start), with flow
    heartbeats off (they add a 1 s floor to every flow run)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def tiny():
    """The embedded policy: (model, tokenizer), fp32 on CPU."""
    from pipeline.models import EMBEDDED_POLICY
    from stages.policy import load_model, load_tokenizer

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


@pytest.fixture(scope="session")
def prefect_server_env(tmp_path_factory):
    """A real `prefect server start` on 127.0.0.1 with its own PREFECT_HOME; yields the environment
    for client processes (PREFECT_API_URL set)."""
    home = tmp_path_factory.mktemp("prefect-home")
    with prefect_servers.local_server(home) as url:
        yield {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
