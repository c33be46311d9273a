"""The same seed and config give identical versions and byte-identical data, run after run."""

from __future__ import annotations

import pytest

from pipeline.store.versions import Store

pytestmark = pytest.mark.usefixtures("prefect_server")


def run_once(runs_dir):
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        seed=7,
        iterations=2,
        task={"name": "calculator,weather", "rollouts": 8, "group_size": 4, "max_turns": 3},
        generation={"max_new_tokens": 48},
        store={"runs_dir": runs_dir},
    )
    rl_training(config)
    store = Store(runs_dir)
    return {f"{m.stage}/{m.version}": m.files for m in store.versions()}


@pytest.mark.slow  # two whole runs
def test_two_runs_write_the_same_versions_with_byte_identical_files(tmp_path):
    first, second = run_once(tmp_path / "a"), run_once(tmp_path / "b")
    assert set(first) == set(second)
    assert len([v for v in first if v.startswith("policy/")]) == 3  # base + 2 iterations
    different = sorted(v for v in first if first[v] != second[v])
    assert different == []
