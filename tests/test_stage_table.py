"""The stage table: one registration line per stage, each stage declared once in its module, and
what is derived from the declarations (versions, inputs, the re-run map)."""

from __future__ import annotations

import inspect

import datasets
import pytest

from pipeline.orchestration.stage_runs import settings_of
from pipeline.orchestration.stage_table import POLICY, ROOT, STAGES, code_version, rerun_map, stage_version
from pipeline.store.lineage import input_of
from pipeline.store.versions import Store
from schemas.config import RunConfig
from schemas.stage import Output, Settings


def versions(config: RunConfig) -> dict[str, str]:
    return {name: stage_version(name, settings_of(name, config), {}, {}) for name in STAGES}


def test_every_stage_declaration_is_whole():
    config = RunConfig()
    for name, stage in STAGES.items():
        settings = settings_of(name, config)
        assert isinstance(settings, stage.settings) and isinstance(settings, Settings), name
        assert isinstance(stage.features, datasets.Features) and stage.features, name
        assert {i.split("#")[0] for i in stage.input_names(settings)} <= {*STAGES, POLICY}, name
        assert stage.rerun_from is None or stage.rerun_from in stage.input_names(settings), name
        assert stage.audits is None or stage.audits in stage.input_names(settings), name
        assert all((ROOT / path).exists() for path in stage.code), name
        assert list(inspect.signature(stage.run).parameters)[:2] == ["inputs", "settings"], name
        assert inspect.signature(stage.run).return_annotation in (Output, "Output"), name
        assert len(code_version(name)) == 16


def test_the_rerun_map_is_the_declarations_and_mtrl_stage_offers_it():
    from pipeline.cli.main import RerunnableStages

    assert list(RerunnableStages()) == list(rerun_map())
    assert rerun_map() == {
        "execute-tools": "generate-rollouts",
        "assign-rewards": "execute-tools",
        "compute-advantages": "assign-rewards",
        "ppo-update": "compute-advantages",
    }


def test_a_changed_config_field_changes_only_the_stages_that_read_it():
    base = versions(RunConfig())
    moved = versions(RunConfig().with_overrides({"advantage.estimator": "rloo"}))
    assert {name for name in STAGES if base[name] != moved[name]} == {"compute-advantages"}
    kl = versions(RunConfig().with_overrides({"ppo.kl_coef": 0.2}))
    assert {name for name in STAGES if base[name] != kl[name]} == {"compute-advantages", "ppo-update"}
    # the scoring passes' layout (equal only to ~1e-6) is compute-advantages' too
    chunks = versions(RunConfig().with_overrides({"ppo.logprob_chunk_tokens": 256}))
    assert {name for name in STAGES if base[name] != chunks[name]} == {"compute-advantages", "ppo-update"}
    turns = versions(RunConfig().with_overrides({"generation.max_new_tokens": 32}))
    assert {name for name in STAGES if base[name] != turns[name]} == {"generate-rollouts"}


def test_where_a_stage_runs_and_how_long_it_may_wait_are_not_hashed():
    """Placement (ppo.nodes), timeouts that only decide when a hung job fails, the audit gate, the
    runner, the store's place and its retention, the vLLM server's place change no version: the
    same computation gives the same bytes."""
    base = RunConfig(runner={"ray_address": "auto"})
    elsewhere = base.with_overrides(
        {
            "ppo.nodes": 2,
            "ppo.world_size": 2,
            "ppo.collective_timeout_s": 30.0,
            "ppo.max_staleness": 1,  # it picks the inputs (which policy generated, which trains): both parents
            "audit.rescore_fraction": 1.0,
            "audit.max_failed_fraction": 0.0,
            "audit.tolerance": 0.01,
            "runner.kind": "ray",
            "runner.shards": 4,
            "runner.max_workers": 2,
            "runner.threads": 3,
            "vllm.start_timeout_s": 10.0,
            "vllm.url": "http://elsewhere:8000",
            "store.runs_dir": "/elsewhere",
            "store.keep_optimizer_state": 1,  # retention deletes AdamW states, never what a version holds
            "iterations": 3,
        }
    )
    same_world = base.with_overrides({"ppo.world_size": 2})  # the world size does shape the bytes
    assert versions(same_world) == versions(elsewhere)
    assert versions(base)["ppo-update"] != versions(same_world)["ppo-update"]


def test_each_stage_hashes_what_its_settings_hold_and_only_that():
    """What a version hashes is the settings the stage's code reads: every field of them, none of
    another stage's (the manifest records the same dict)."""
    settings = settings_of("compute-advantages", RunConfig()).hashed()
    assert {"estimator", "gamma", "kl_coef", "logprob_chunk_tokens", "micro_batch_rollouts", "device"} <= set(settings)
    assert not {"learning_rate", "max_new_tokens", "timeout_s"} & set(settings)
    assert settings["device"] == "cpu"  # model.device "auto", as it resolves here
    generation = settings_of("generate-rollouts", RunConfig()).hashed()
    assert generation["engine"]["vllm"] == {} and "runs_dir" not in generation["engine"]  # placement: left out
    assert set(generation["tasks"]["code"]) == {"calculator"}  # the environment's code, hashed


def test_the_inputs_a_stage_is_not_given_are_found_through_the_lineage(tmp_path):
    """The rollouts' policy (a critic, a tokenizer) and the KL reference of its lineage."""
    store = Store(tmp_path)

    def write(stage: str, version: str, parents: dict, iteration: int = 0) -> None:
        rows = datasets.Dataset.from_dict({"x": [1]})
        store.write(
            stage, version, lambda tmp: rows.save_to_disk(str(tmp)) or {}, {"parents": parents, "iteration": iteration}
        )

    write(POLICY, "p0", {}, -1)
    write("generate-rollouts", "g0", {POLICY: "p0"})
    write("execute-tools", "e0", {"generate-rollouts": "g0", POLICY: "p0"})
    write("assign-rewards", "a0", {"execute-tools": "e0"})
    write("compute-advantages", "c0", {"assign-rewards": "a0"})
    write("ppo-update", "u0", {"compute-advantages": "c0", POLICY: "p0"})
    write(POLICY, "p1", {"ppo-update": "u0"}, 0)
    write("generate-rollouts", "g1", {POLICY: "p1"}, 1)
    assert input_of(store, POLICY, {"generate-rollouts": "g1"}) == "p1"
    assert input_of(store, f"{POLICY}#reference", {"generate-rollouts": "g1"}) == "p0"
    assert input_of(store, POLICY, {"assign-rewards": "a0"}) == "p0"
    assert input_of(store, POLICY, {"compute-advantages": "c0", POLICY: "p1"}) == "p1"  # given: kept
    assert input_of(store, "execute-tools", {POLICY: "p1"}) is None  # the previous turn: only a caller knows it


HEAVY = ("prefect", "reasoning_gym", "textarena", "mcp", "fastmcp", "openenv")  # imported only when needed


def test_reading_the_store_imports_neither_prefect_nor_torch(tmp_path):
    """mtrl ls/show/lineage answer from the manifests alone: neither Prefect, torch, transformers,
    the stages nor an ecosystem package is even imported (the store knows no stage)."""
    import subprocess
    import sys

    store = Store(tmp_path)
    rows = datasets.Dataset.from_dict({"x": [1]})
    store.write("assign-rewards", "a1", lambda tmp: rows.save_to_disk(str(tmp)) or {}, {"iteration": 0})
    code = (
        "import sys; from pipeline.cli.main import main\n"
        f"for command in (['ls'], ['show', 'assign-rewards/a1'], ['lineage', 'assign-rewards/a1']):\n"
        f"    assert main([*command, '--runs-dir', {str(tmp_path)!r}]) == 0\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {(*HEAVY, 'torch', 'transformers', 'stages')!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # a whole run in a process of its own (about 13 s)
def test_a_run_of_mtrls_own_tasks_imports_no_ecosystem_package():
    """The adapters are imported by name, only for a task that uses them: the versions of a run of
    the built-in tasks are computed without reasoning-gym, textarena, MCP or OpenEnv."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom schemas.config import RunConfig\nfrom pipeline.orchestration.stage_runs import settings_of\n"
        "from pipeline.orchestration.stage_table import stage_version\n"
        "from stages.generate_rollouts import GenerateSettings, rollout_starts\n"
        "config = RunConfig(task={'name': 'calculator,weather,guess-number'})\n"
        "rollout_starts(GenerateSettings.resolve(config), 0)\n"
        "for stage in ('generate-rollouts', 'execute-tools', 'assign-rewards', 'sft'):\n"
        "    stage_version(stage, settings_of(stage, config), {}, {})\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY[1:]!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_upgrading_a_library_that_shapes_the_bytes_gives_new_versions(monkeypatch):
    from importlib import metadata

    from runtime.hashing import package_version

    before = versions(RunConfig())
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "99.0" if name == "transformers" else real(name))
    package_version.cache_clear()  # a process looks its libraries up once: an upgrade is a new process
    try:
        after = versions(RunConfig())
    finally:
        package_version.cache_clear()
    assert all(before[name] != after[name] for name in STAGES)
