"""The stage table is the one list of stages: every entry must point at real code and config."""

from __future__ import annotations

import importlib

import datasets

from pipeline.lineage import lineage_config
from pipeline.stage_table import DERIVED, POLICY, ROOT, STAGES
from pipeline.store import Store
from schemas.config import RunConfig


def test_every_stage_entry_points_at_real_code_schemas_and_config():
    config = RunConfig()
    for name, stage in STAGES.items():
        module, _, function = stage.function.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
        assert isinstance(stage.features, datasets.Features) and stage.features, name
        assert {i.split("#")[0] for i in stage.inputs} <= {*STAGES, POLICY}, name
        assert stage.rerun_from is None or stage.rerun_from in stage.inputs, name
        assert set(stage.derived) <= set(DERIVED), name
        assert all((ROOT / path).exists() for path in stage.code), name
        config.pick(*stage.config)  # raises KeyError on a field that does not exist
        assert len(stage.code_version) == 16


def test_a_changed_config_field_changes_only_the_stages_that_record_it():
    from pipeline.tasks import stage_version

    base, changed = RunConfig(), RunConfig().with_overrides({"advantage.estimator": "rloo"})
    moved = {name for name in STAGES if stage_version(base, name, {}, {}) != stage_version(changed, name, {}, {})}
    assert moved == {"compute-advantages"}
    kl = RunConfig().with_overrides({"ppo.kl_coef": 0.2})
    moved = {name for name in STAGES if stage_version(base, name, {}, {}) != stage_version(kl, name, {}, {})}
    assert moved == {"compute-advantages", "ppo-update"}


def test_where_a_stage_runs_and_how_long_it_may_wait_are_not_hashed():
    """Placement (ppo.nodes), timeouts that only decide when a hung job fails, the audit gate, the
    runner, the store's place and its retention change no version: the same computation gives
    the same bytes."""
    from pipeline.tasks import stage_version

    base = RunConfig(runner={"ray_address": "auto"})
    elsewhere = base.with_overrides(
        {
            "ppo.nodes": 2,
            "ppo.world_size": 2,
            "ppo.collective_timeout_s": 30.0,
            "audit.rescore_fraction": 1.0,
            "audit.max_failed_fraction": 0.0,
            "runner.kind": "ray",
            "runner.shards": 4,
            "vllm.start_timeout_s": 10.0,
            "store.runs_dir": "/elsewhere",
            "store.keep_optimizer_state": 1,  # retention deletes AdamW states, never what a version holds
        }
    )
    same_world = base.with_overrides({"ppo.world_size": 2})  # the world size does shape the bytes
    for name in STAGES:
        assert stage_version(same_world, name, {}, {}) == stage_version(elsewhere, name, {}, {}), name
    assert stage_version(base, "ppo-update", {}, {}) != stage_version(same_world, "ppo-update", {}, {})


def test_lineage_config_merges_the_fields_each_ancestor_recorded(tmp_path):
    store = Store(tmp_path)

    def write(stage: str, version: str, config: dict, parents: dict) -> None:
        rows = datasets.Dataset.from_dict({"x": [1]})
        store.write(
            stage, version, lambda tmp: rows.save_to_disk(str(tmp)) or {}, {"config": config, "parents": parents}
        )

    write("assign-rewards", "a1", {"reward": {"overlong_reward": 0.5}, "ppo": {"kl_coef": 0.1}}, {})
    write(
        "compute-advantages",
        "b1",
        {"advantage": {"estimator": "rloo"}, "ppo": {"kl_in": "loss"}},
        {"assign-rewards": "a1"},
    )
    merged = lineage_config(store, "compute-advantages", "b1")
    # the two partial ppo records are merged, not one replacing the other
    assert merged == {
        "reward": {"overlong_reward": 0.5},
        "ppo": {"kl_coef": 0.1, "kl_in": "loss"},
        "advantage": {"estimator": "rloo"},
    }
    config = RunConfig.model_validate(merged)
    assert config.ppo.kl_coef == 0.1 and config.ppo.kl_in == "loss" and config.advantage.estimator == "rloo"


HEAVY = ("prefect", "reasoning_gym", "textarena", "mcp", "fastmcp", "openenv")  # imported only when needed


def test_reading_the_store_does_not_import_prefect(tmp_path):
    """mtrl ls/show/lineage answer from the manifests alone: neither Prefect nor an ecosystem
    package is even imported."""
    import subprocess
    import sys

    store = Store(tmp_path)
    rows = datasets.Dataset.from_dict({"x": [1]})
    store.write("assign-rewards", "a1", lambda tmp: rows.save_to_disk(str(tmp)) or {}, {"iteration": 0})
    code = (
        "import sys; from pipeline.cli import main\n"
        f"for command in (['ls'], ['show', 'assign-rewards/a1'], ['lineage', 'assign-rewards/a1']):\n"
        f"    assert main([*command, '--runs-dir', {str(tmp_path)!r}]) == 0\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_run_of_mtrls_own_tasks_imports_no_ecosystem_package():
    """The adapters are imported by name, only for a task that uses them: the versions of a run of
    the built-in tasks are computed without reasoning-gym, textarena, MCP or OpenEnv."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom schemas.config import RunConfig\nfrom pipeline.tasks import stage_version\n"
        "from stages.task_mix import check_environments, rollout_starts\n"
        "config = RunConfig(task={'name': 'calculator,weather,guess-number'})\n"
        "check_environments(config); rollout_starts(config, 0)\n"
        "for stage in ('generate-rollouts', 'execute-tools', 'assign-rewards', 'sft'):\n"
        "    stage_version(config, stage, {}, {})\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY[1:]!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_upgrading_a_library_that_shapes_the_bytes_gives_new_versions(monkeypatch):
    from importlib import metadata

    from pipeline.tasks import stage_version
    from runtime.hashing import package_version

    config = RunConfig()
    before = {name: stage_version(config, name, {}, {}) for name in STAGES}
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "99.0" if name == "transformers" else real(name))
    package_version.cache_clear()  # a process looks its libraries up once: an upgrade is a new process
    try:
        after = {name: stage_version(config, name, {}, {}) for name in STAGES}
    finally:
        package_version.cache_clear()
    assert all(before[name] != after[name] for name in STAGES)


def test_mtrl_stage_dispatches_every_rerunnable_stage_of_the_table():
    """The stages `mtrl stage` re-runs are the table's (rerun_from), each through its verb."""
    from pipeline.tasks import ON_ONE_INPUT

    assert set(ON_ONE_INPUT) == {name for name, stage in STAGES.items() if stage.rerun_from}
