"""The stage table: the stages mtrl runs, one registration line each. Every fact about a stage is
declared once, in its own module (schemas/stage.py: the contract); the rest is derived here: the
code its version hashes, its version, the re-run map of `mtrl stage`.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

from runtime.hashing import SHAPING_LIBRARIES, library_versions, module_closure, source_version, version_key
from schemas.stage import POLICY, Settings, Stage
from stages import assign_rewards, compute_advantages, execute_tools, generate_rollouts, ppo_update, sft

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        generate_rollouts.STAGE,
        execute_tools.STAGE,
        assign_rewards.STAGE,
        compute_advantages.STAGE,
        ppo_update.STAGE,
        sft.STAGE,
    )
}


def rerun_map() -> dict[str, str]:
    """`mtrl stage NAME --from STAGE/VERSION`: each stage that re-runs on one stored input, and that input."""
    return {name: stage.rerun_from for name, stage in STAGES.items() if stage.rerun_from}


ROOT = Path(__file__).resolve().parents[2]  # the checkout: pipeline/orchestration/ is two folders down
# Every stage's output depends on the row schema, the token-stream contract and the stage contract.
SHARED_CODE = ("schemas/features.py", "schemas/token_stream.py", "schemas/stage.py")
# A stage's code is followed through its imports into these packages only: stages/ and schemas/ hold
# everything that shapes a stage's output. runtime/ (launchers, samplers, hashing) shapes none, the
# pipeline only orchestrates (stages may not import it), and schemas/config.py, the run config with
# its help texts, is imported by no stage: a stage reads its settings, and its version hashes their
# values (tests/test_layout.py).
HASHED_PACKAGES = ("stages", "schemas")


@functools.cache
def code_files(name: str) -> list[Path]:
    """The source files a stage's output depends on: its module, what it imports of stages/ and
    schemas/, transitively (imports inside functions included), and what it declares besides."""
    stage = STAGES[name]
    entries = [Path(inspect.getsourcefile(stage.run))]
    for path in (ROOT / name for name in (*stage.code, *SHARED_CODE)):
        entries += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return module_closure(entries, ROOT, HASHED_PACKAGES)


@functools.cache
def code_version(name: str) -> str:
    """A hash of code_files: editing any of them gives new versions. Hashed once per process (at
    its first stage run, its code already imported): a file edited while a process runs does not
    change the code that process runs. A hash reads ~20 files (~0.5 ms)."""
    return source_version(*code_files(name))


def stage_version(name: str, settings: Settings, parents: dict[str, str], position: dict[str, int]) -> str:
    """The version a stage's output will have, known before it runs: its settings, its code, the
    versions of its inputs, its position (iteration and turn: the same settings give new rollouts
    each turn) and the libraries that shape its bytes."""
    hashed: dict[str, Any] = {
        "settings": settings.hashed(),
        "position": position,
        "libraries": library_versions(SHAPING_LIBRARIES),
    }
    return version_key(name, code_version(name), hashed, parents)


__all__ = ["POLICY", "ROOT", "STAGES", "code_files", "code_version", "rerun_map", "stage_version"]
