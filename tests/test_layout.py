"""The layout's rules, checked on the source (docs/architecture.md):

- four layers, imports pointing down only: schemas <- runtime <- stages <- pipeline, and inside
  pipeline/ its sub-packages: store, prefect_plumbing <- models, monitoring <- orchestration <- cli;
- no import circle anywhere;
- stages never import each other (they meet through schemas/, the store and the shared modules);
- a stage's version hashes exactly the code that shapes its output: its closure holds what it
  must and none of what it must not (another stage, a launcher, a sampler, the pipeline).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.orchestration.stage_table import HASHED_PACKAGES, ROOT, STAGES, code_files
from runtime.hashing import imported_files, module_closure

LAYERS = ("schemas", "runtime", "stages", "pipeline")  # lowest first: a module imports its own layer or lower
STAGE_PACKAGES = (  # the stages proper; every other module of stages/ is shared
    "stages.generate_rollouts",
    "stages.execute_tools",
    "stages.assign_rewards",
    "stages.compute_advantages",
    "stages.ppo_update",
    "stages.sft",
)


@functools.cache
def project_modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the four layers."""
    modules = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


@functools.cache
def imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (imports inside functions included), read by the
    same parser that follows a stage's imports for its version (runtime/hashing.py)."""
    module_of = {path: name for name, path in project_modules().items()}
    return {
        name: {module_of[f] for f in imported_files(path, ROOT, LAYERS)} - {name}
        for name, path in project_modules().items()
    }


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def stage_of(module: str) -> str | None:
    return next((package for package in STAGE_PACKAGES if in_package(module, package)), None)


def test_every_module_of_the_four_layers_is_found():
    modules = project_modules()
    assert {"schemas.config", "runtime.processes", "stages.ppo_update.worker", "pipeline.orchestration.flows"} <= set(
        modules
    )
    assert len(imports()) == len(modules)


def test_imports_point_down_the_layers():
    wrong = [
        f"{module} ({module.split('.')[0]}) imports {imported} ({imported.split('.')[0]})"
        for module, imported_modules in imports().items()
        for imported in imported_modules
        if LAYERS.index(imported.split(".")[0]) > LAYERS.index(module.split(".")[0])
    ]
    assert not wrong, "an import runs up the layers schemas <- runtime <- stages <- pipeline:\n" + "\n".join(wrong)


# pipeline/'s sub-packages, lowest first: a module imports its own sub-package or one of a lower level
PIPELINE_LEVELS = (("store", "prefect_plumbing"), ("models", "monitoring"), ("orchestration",), ("cli",))


def test_pipelines_sub_packages_import_only_lower_ones():
    level = {f"pipeline.{package}": i for i, packages in enumerate(PIPELINE_LEVELS) for package in packages}
    sub_package = {
        module: ".".join(module.split(".")[:2]) for module in project_modules() if in_package(module, "pipeline")
    }
    assert set(sub_package.values()) == {"pipeline", *level}  # every sub-package has its level
    wrong = [
        f"{module} imports {imported}"
        for module, imported_modules in imports().items()
        if module in sub_package and sub_package[module] != "pipeline"
        for imported in imported_modules
        if imported in sub_package
        and sub_package[imported] != sub_package[module]
        and level.get(sub_package[imported], -1) >= level[sub_package[module]]
    ]
    assert not wrong, f"pipeline/'s sub-packages import down the levels {PIPELINE_LEVELS} only:\n" + "\n".join(wrong)


def test_there_is_no_import_circle():
    graph = imports()
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_stages_never_import_each_other():
    wrong = []
    for module, imported_modules in imports().items():
        if not in_package(module, "stages"):
            continue
        for imported in imported_modules:
            theirs = stage_of(imported)
            if theirs is not None and theirs != stage_of(module):
                wrong.append(f"{module} imports {imported} (the stage {theirs})")
    assert not wrong, "stages meet through schemas/, the store and the shared modules only:\n" + "\n".join(wrong)


# Per stage: files its version must hash, and files it must not (they do not shape its output).
MUST = {
    "generate-rollouts": {"stages/registry.py", "stages/tools.py", "stages/environments.py", "schemas/task_mix.py",
                          "stages/policy/loading.py", "schemas/stage.py",
                          "stages/generate_rollouts/hf.py", "stages/generate_rollouts/vllm_engine.py",
                          "stages/generate_rollouts/vllm_extension/mtrl_vllm_extension.py"},
    "execute-tools": {"stages/execute_tools/calls.py", "stages/registry.py", "stages/tools.py",
                      "stages/environments.py", "stages/python_tool.py"},
    "assign-rewards": {"stages/assign_rewards.py", "stages/environments.py", "stages/registry.py"},
    "compute-advantages": {"stages/compute_advantages.py", "stages/policy/batching.py", "stages/policy/scoring.py"},
    "ppo-update": {"stages/ppo_update/__init__.py", "stages/ppo_update/train.py", "stages/ppo_update/worker.py",
                   "stages/ppo_update/checkpoint.py",
                   "stages/policy/batching.py", "stages/policy/scoring.py", "stages/sharding.py"},
    # demonstrations are rendered as the rollouts' token streams and scored as PPO scores
    "sft": {"stages/sft.py", "stages/environments.py", "stages/registry.py", "stages/policy/scoring.py",
            "schemas/token_stream.py"},
}  # fmt: skip
MUST_NOT = {
    # the tool sandbox runs calls: generation renders the tools' schemas only; it scores and trains nothing
    "generate-rollouts": {"stages/execute_tools/calls.py", "stages/execute_tools/worker.py", "stages/sharding.py",
                          "stages/ppo_update/__init__.py", "stages/compute_advantages.py",
                          "stages/policy/batching.py", "stages/policy/scoring.py"},
    # the vLLM and HF engines generate; tools never need them. An ecosystem adapter is hashed
    # through its task's environment code, in the runs that use it only (stages/registry.py)
    "execute-tools": {"stages/generate_rollouts/vllm_engine.py", "stages/generate_rollouts/hf.py",
                      "stages/generate_rollouts/__init__.py", "stages/policy/batching.py", "stages/policy/scoring.py",
                      "stages/ecosystem/reasoning_gym.py", "stages/ecosystem/textarena.py",
                      "stages/ecosystem/openenv.py", "stages/ecosystem/mcp.py"},
    "assign-rewards": {"stages/execute_tools/calls.py", "stages/policy/loading.py", "stages/generate_rollouts/__init__.py"},
    "compute-advantages": {"stages/ppo_update/__init__.py", "stages/sharding.py", "stages/generate_rollouts/hf.py"},
    "ppo-update": {"stages/generate_rollouts/__init__.py", "stages/compute_advantages.py"},
    # it starts from an imported model: no rollouts, no tool sandbox, no PPO optimiser state
    "sft": {"stages/ppo_update/__init__.py", "stages/ppo_update/checkpoint.py", "stages/generate_rollouts/__init__.py",
            "stages/execute_tools/calls.py", "stages/sharding.py"},
}  # fmt: skip
# What no stage hashes: the run config's module (help texts, every stage's fields: a stage reads its
# settings and hashes their values), the manifest (bookkeeping), the launchers and samplers of
# runtime/ and all of pipeline/ (the test below)
NEVER = {"schemas/config.py", "schemas/manifest.py"}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_version_hashes_exactly_the_code_that_shapes_its_output(stage):
    hashed = {str(path.relative_to(ROOT)) for path in code_files(stage)}
    assert MUST[stage] <= hashed, f"{stage} does not hash {sorted(MUST[stage] - hashed)}"
    assert not (MUST_NOT[stage] | NEVER) & hashed, f"{stage} hashes {sorted((MUST_NOT[stage] | NEVER) & hashed)}"
    outside = sorted(path for path in hashed if path.split("/")[0] not in HASHED_PACKAGES)
    assert not outside, f"{stage} hashes {outside}: only stages/ and schemas/ shape a stage's output"


def test_runtime_and_pipeline_are_never_followed_into_a_closure(tmp_path):
    """A stage may use a launcher or a sampler of runtime/ without hashing it, and an import for type
    hints only (under `if TYPE_CHECKING:`) never runs: it is not followed either."""
    user = tmp_path / "user.py"
    user.write_text(
        "from typing import TYPE_CHECKING\nfrom runtime.memory import peak_memory\nfrom pipeline.store.versions import Store\n"
        "import schemas.features\nif TYPE_CHECKING:\n    from schemas.manifest import Manifest\n"
    )
    closure = {str(path) for path in module_closure([user], ROOT, HASHED_PACKAGES)}
    assert closure == {str(user), str(ROOT / "schemas/features.py")}


# One iteration's versions as a run chains them (each stage's parents are the versions before it),
# computed in the tree the process runs from, with the run config's overrides given as JSON.
CHAINED_VERSIONS = """
import json, sys
from pipeline.orchestration.stage_runs import POLICY_CODE_VERSION, settings_of
from pipeline.orchestration.stage_table import POLICY, stage_version
from runtime.hashing import version_key
from schemas.config import RunConfig



def chained_versions(config):
    def version(name, parents, position=None):
        return stage_version(name, settings_of(name, config), parents, position or {})

    start = "starting-policy"
    made = {"generate-rollouts": version("generate-rollouts", {POLICY: start}, {"iteration": 0, "turn": 0})}
    made["execute-tools"] = version("execute-tools", {"generate-rollouts": made["generate-rollouts"], POLICY: start})
    made["assign-rewards"] = version("assign-rewards", {"execute-tools": made["execute-tools"]})
    made["compute-advantages"] = version("compute-advantages", {"assign-rewards": made["assign-rewards"]})
    made["ppo-update"] = version("ppo-update", {"compute-advantages": made["compute-advantages"], POLICY: start})
    made["policy"] = version_key(POLICY, POLICY_CODE_VERSION, {}, {"ppo-update": made["ppo-update"]})
    made["sft"] = version("sft", {POLICY: start})
    return made


# one config per argument: the copy's defaults, overridden
print(json.dumps([chained_versions(RunConfig.model_validate_json(overrides)) for overrides in sys.argv[1:]]))
"""
ITERATION = ("generate-rollouts", "execute-tools", "assign-rewards", "compute-advantages", "ppo-update", "policy")


@pytest.mark.slow
def test_a_version_changes_exactly_when_what_its_stage_computes_changes(tmp_path):
    """In a copy of mtrl, edit and compute one iteration's versions each time:
    - a config field's help text, the vLLM server process, the torchrun launcher, the flow: no version;
    - the stale-rollouts rule of ppo-update: ppo-update and the policy it writes, nothing upstream;
    - a setting only compute-advantages reads: compute-advantages and its consumers, not the rollouts;
    - another stage's setting (a default only ppo-update reads): ppo-update and its policy only;
    - the vLLM engine (what it asks the server for): generate-rollouts and what follows it, on the
      hf engine too (the module registers vllm); the warm start not."""
    copy = tmp_path / "mtrl"
    for package in LAYERS:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "embedded"))
    shutil.copytree(ROOT / "pipeline" / "models" / "embedded", copy / "pipeline" / "models" / "embedded")

    def versions(*configs: dict) -> list[dict[str, str]]:
        """The chained versions under each config (default: one, the copy's defaults), in one process."""
        env = {**os.environ, "PYTHONPATH": str(copy)}
        done = subprocess.run(
            [sys.executable, "-c", CHAINED_VERSIONS, *(json.dumps(config) for config in configs or ({},))],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def edit(path: str, old: str, new: str) -> None:
        text = (copy / path).read_text()
        assert text.count(old) == 1, f"{path}: the text to edit is not there once"
        (copy / path).write_text(text.replace(old, new))

    def changed(after: dict[str, str]) -> set[str]:
        return {name for name in before if after[name] != before[name]}

    before = versions()[0]
    edit("schemas/config.py", '"Wall-clock limit per tool call, in seconds."', '"Seconds a tool call may take."')
    edit(
        "runtime/vllm_server.py",
        "class EngineError(RuntimeError):",
        "LOG_NAME = 'vllm.log'\n\n\nclass EngineError(RuntimeError):",
    )
    edit("runtime/launch.py", "LAST_LINES = 30", "LAST_LINES = 40")
    edit("pipeline/orchestration/flows.py", "def experience(", "def _an_edit() -> None:\n    pass\n\n\ndef experience(")
    assert changed(versions()[0]) == set()

    edit(
        "stages/ppo_update/__init__.py",
        "    if stale:\n        return True\n",
        "    if stale or settings.tis_cap > 1:\n        return True\n",
    )
    after, gamma = versions({}, {"advantage": {"gamma": 0.5}})
    assert changed(after) == {"ppo-update", "policy"}
    before = after
    assert changed(gamma) == {"compute-advantages", "ppo-update", "policy"}

    edit("schemas/config.py", "weight_decay: float = Field(0.0,", "weight_decay: float = Field(0.01,")
    after = versions()[0]
    assert changed(after) == {"ppo-update", "policy"}
    before = after

    edit("stages/generate_rollouts/vllm_engine.py", 'SERVED_MODEL_NAME = "policy"', 'SERVED_MODEL_NAME = "the-policy"')
    assert changed(versions()[0]) == set(ITERATION)
