"""The layout's rules, checked on the source (docs/architecture.md):

- four layers, imports pointing down only: schemas <- runtime <- stages <- pipeline;
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

from pipeline.stage_table import HASHED_PACKAGES, ROOT, STAGES
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
    assert {"schemas.config", "runtime.processes", "stages.ppo_update.worker", "pipeline.flows"} <= set(modules)
    assert len(imports()) == len(modules)


def test_imports_point_down_the_layers():
    wrong = [
        f"{module} ({module.split('.')[0]}) imports {imported} ({imported.split('.')[0]})"
        for module, imported_modules in imports().items()
        for imported in imported_modules
        if LAYERS.index(imported.split(".")[0]) > LAYERS.index(module.split(".")[0])
    ]
    assert not wrong, "an import runs up the layers schemas <- runtime <- stages <- pipeline:\n" + "\n".join(wrong)


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
    "generate-rollouts": {"stages/task_mix.py", "stages/registry.py", "stages/tools.py", "stages/environments.py",
                          "stages/policy.py",
                          "stages/generate_rollouts/hf.py", "stages/generate_rollouts/vllm_engine.py",
                          "stages/generate_rollouts/vllm_extension/mtrl_vllm_extension.py"},
    "execute-tools": {"stages/execute_tools/calls.py", "stages/registry.py", "stages/tools.py",
                      "stages/environments.py", "stages/python_tool.py"},
    "assign-rewards": {"stages/assign_rewards.py", "stages/environments.py"},
    "compute-advantages": {"stages/compute_advantages.py", "stages/policy.py"},
    "ppo-update": {"stages/ppo_update/__init__.py", "stages/ppo_update/worker.py", "stages/ppo_update/checkpoint.py",
                   "stages/policy.py", "stages/sharding.py"},
    # demonstrations are rendered as the rollouts' token streams and scored as PPO scores
    "sft": {"stages/sft.py", "stages/environments.py", "stages/registry.py", "stages/policy.py",
            "schemas/token_stream.py"},
}  # fmt: skip
MUST_NOT = {
    # the tool sandbox runs calls: generation renders the tools' schemas only
    "generate-rollouts": {"stages/execute_tools/calls.py", "stages/execute_tools/worker.py", "stages/sharding.py",
                          "stages/ppo_update/__init__.py", "stages/compute_advantages.py"},
    # the vLLM and HF engines generate; tools never need them. An ecosystem adapter is hashed
    # through its task's environment code, in the runs that use it only (stages/registry.py)
    "execute-tools": {"stages/generate_rollouts/vllm_engine.py", "stages/generate_rollouts/hf.py",
                      "stages/generate_rollouts/__init__.py", "stages/task_mix.py", "stages/policy.py",
                      "stages/ecosystem/reasoning_gym.py", "stages/ecosystem/textarena.py",
                      "stages/ecosystem/openenv.py", "stages/ecosystem/mcp.py"},
    "assign-rewards": {"stages/execute_tools/calls.py", "stages/policy.py", "stages/generate_rollouts/__init__.py"},
    "compute-advantages": {"stages/ppo_update/__init__.py", "stages/sharding.py", "stages/generate_rollouts/hf.py"},
    # (the torchrun/Ray launcher, pipeline/launch.py, decides where the ranks run, as ppo.nodes does:
    # like all of pipeline/ and runtime/ it is never hashed, which the test below checks for every stage)
    "ppo-update": {"stages/generate_rollouts/__init__.py"},
    # it starts from an imported model: no rollouts, no tool sandbox, no PPO optimiser state
    "sft": {"stages/ppo_update/__init__.py", "stages/ppo_update/checkpoint.py", "stages/generate_rollouts/__init__.py",
            "stages/execute_tools/calls.py", "stages/sharding.py"},
}  # fmt: skip


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_version_hashes_exactly_the_code_that_shapes_its_output(stage):
    hashed = {str(path.relative_to(ROOT)) for path in STAGES[stage].code_files}
    assert MUST[stage] <= hashed, f"{stage} does not hash {sorted(MUST[stage] - hashed)}"
    assert not MUST_NOT[stage] & hashed, f"{stage} hashes {sorted(MUST_NOT[stage] & hashed)}, which do not shape it"
    outside = sorted(path for path in hashed if path.split("/")[0] not in HASHED_PACKAGES)
    assert not outside, f"{stage} hashes {outside}: only stages/ and schemas/ shape a stage's output"


def test_runtime_and_pipeline_are_never_followed_into_a_closure(tmp_path):
    """A stage may use a launcher or a sampler of runtime/ without hashing it."""
    user = tmp_path / "user.py"
    user.write_text(
        "from runtime.memory import peak_memory\nfrom pipeline.store import Store\nimport schemas.features\n"
    )
    closure = {str(path) for path in module_closure([user], ROOT, HASHED_PACKAGES)}
    assert closure == {str(user), str(ROOT / "schemas/features.py")}


STAGE_VERSIONS = """
import json
from pipeline.stage_table import STAGES
from pipeline.tasks import stage_version
from schemas.config import RunConfig
print(json.dumps({name: stage_version(RunConfig(), name, {}, {}) for name in STAGES}))
"""


@pytest.mark.slow
def test_editing_the_vllm_server_process_versions_nothing_and_editing_the_vllm_engine_versions_rollouts(tmp_path):
    """In a copy of mtrl: a log line added to runtime/vllm_server.py (how the server process starts,
    is watched and stops) leaves every stage's version; one added to the engine (what it asks the
    server for) gives generate-rollouts a new one, on the hf engine too (the module registers vllm)."""
    copy = tmp_path / "mtrl"
    for package in HASHED_PACKAGES + ("pipeline", "runtime"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))

    def versions() -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(copy)}
        done = subprocess.run(
            [sys.executable, "-c", STAGE_VERSIONS], cwd=copy, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def edit(path: str) -> None:
        (copy / path).write_text((copy / path).read_text() + '\nLOG_NAME = "vllm-server.log"  # an edit\n')

    from pipeline.tasks import stage_version
    from schemas.config import RunConfig

    before = {name: stage_version(RunConfig(), name, {}, {}) for name in STAGES}  # this tree's: the same files
    edit("runtime/vllm_server.py")
    assert versions() == before
    edit("stages/generate_rollouts/vllm_engine.py")
    after = versions()
    assert after["generate-rollouts"] != before["generate-rollouts"]
    assert {name: v for name, v in after.items() if name != "generate-rollouts"} == {
        name: v for name, v in before.items() if name != "generate-rollouts"
    }
