"""The stage table: every fact about a stage, in one place (see docs/architecture.md).

The store's folders, the Arrow schema a version must have, what goes into its version hash
(config fields, derived values, code), where it may run and whether `mtrl stage` re-runs it:
all of it is read from STAGES. Adding a stage is one entry here, its module in stages/ and
its Prefect task in pipeline/tasks.py.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Features

from runtime.hashing import module_closure, package_version, source_version
from schemas import features
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
POLICY = "policy"  # the other kind of stored version: a checkpoint written by ppo-update or sft
# Every stage's output depends on the row schema and the token-stream contract.
SHARED_CODE = ("schemas/features.py", "schemas/token_stream.py")
# A stage's code is followed through its imports into these packages only: stages/ and schemas/ hold
# everything that shapes a stage's output. runtime/ (launchers, samplers, hashing) shapes none, and
# the pipeline only orchestrates (stages may not import it: tests/test_layout.py).
HASHED_PACKAGES = ("stages", "schemas")
# Libraries whose versions shape a stage's bytes, hashed into every version: transformers renders
# chat templates and runs the model, tokenizers tokenizes, torch computes, datasets and pyarrow
# write the rows, numpy computes advantages, safetensors stores weights. Prefect, Ray and pydantic
# only orchestrate and validate: left out, so upgrading them keeps the cache. A manifest records
# these and the two that wrote it (library_versions), once.
SHAPING_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "pyarrow", "numpy", "safetensors")
WRITING_LIBRARIES = ("prefect", "mtrl")


@dataclass(frozen=True)
class Stage:
    name: str
    function: str  # "module:function", the pure function over datasets that does the work
    inputs: tuple[str, ...]  # the stored versions it may read (its manifest's parents)
    features: Features  # the Arrow schema of its dataset
    config: tuple[str, ...]  # config fields its output depends on (hashed into its version)
    # fields inside `config` that only say where it runs or how long it may wait, not what it
    # computes: left out of its version
    placement: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()  # values computed from the config, hashed too (see DERIVED)
    code: tuple[str, ...] = ()  # where its code starts (a folder: its *.py); what they import is followed
    distributed: bool = False  # may run as Ray tasks (runner.kind=ray); generation and training hold a model
    rerun_from: str | None = None  # `mtrl stage NAME --from STAGE/VERSION` re-runs it on this input
    writes_policy: bool = False  # its output is its metrics dataset and the policy it trained (manifest `policy`)

    @functools.cached_property
    def code_files(self) -> list[Path]:
        """The source files its output depends on: its code and every module of stages/ and
        schemas/ it imports, transitively (imports inside functions included)."""
        entries = []
        for name in (*self.code, *SHARED_CODE):
            path = ROOT / name
            entries += sorted(path.glob("*.py")) if path.is_dir() else [path]
        return module_closure(entries, ROOT, HASHED_PACKAGES)

    @functools.cached_property
    def code_version(self) -> str:
        """A hash of code_files: editing any of them gives new versions. Hashed once per process
        (at its first stage run, its code already imported): a file edited while a process runs
        does not change the code that process runs. A hash reads ~20 files (~0.5 ms)."""
        return source_version(*self.code_files)

    def recorded_config(self, config: RunConfig) -> dict[str, Any]:
        """The part of the run config this stage's output depends on, as a partial config."""
        return config.pick(*self.config, leave_out=self.placement)

    def derived_values(self, config: RunConfig) -> dict[str, Any]:
        values = {name: DERIVED[name](config) for name in self.derived}
        return {name: value for name, value in values.items() if value is not None}  # None: does not apply


def library_versions(names: tuple[str, ...] = SHAPING_LIBRARIES + WRITING_LIBRARIES) -> dict[str, str]:
    """Python's version and these libraries': what a manifest records (all of them) and what a
    version hashes (the shaping ones)."""
    return {"python": platform.python_version(), **{n: package_version(n) or "absent" for n in names}}


def _device(config: RunConfig) -> str:
    from stages.policy import pick_device  # imports torch: only when a version is computed

    return pick_device(config.model.device).type


def _environment_code(config: RunConfig) -> dict[str, str]:
    from stages.registry import environment_code

    return environment_code(config)


def _sft_task(config: RunConfig) -> dict[str, Any]:
    """The warm start's task mix (sft.task, else task.name) and the code of its environments."""
    from stages.registry import environments_code

    mix = config.sft_task_mix()
    return {"mix": mix, "environment_code": environments_code(config, [name for name, _ in mix])}


def _engine_version(config: RunConfig) -> str | None:
    if config.generation.engine != "vllm":
        return None  # the in-process engine's libraries are the shaping libraries
    from runtime.vllm_server import vllm_version

    return vllm_version(config.vllm.python, config.vllm.url)


def _fresh_optimizer(config: RunConfig) -> str | None:
    # on only where it takes effect (pipeline.tasks.optimizer_start resolves it before the version)
    if not config.store.fresh_optimizer_if_pruned:
        return None  # AdamW continues the policy's state, or starts fresh from a policy that never had one
    return "the AdamW state of the policy it trains was pruned by retention: a fresh AdamW"


DERIVED: dict[str, Callable[[RunConfig], Any]] = {
    "device": _device,  # kernels differ by device, so do the numbers
    "environment_code": _environment_code,  # the environments and tools of the task mix (user plugins too)
    "engine_version": _engine_version,  # an engine in its own environment: its library's version (vLLM)
    "sft_task": _sft_task,  # what the warm start's demonstrations are of, and the code that writes them
    "fresh_optimizer": _fresh_optimizer,  # ppo-update: a fresh AdamW in place of a pruned state
}

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        Stage(
            name="generate-rollouts",
            function="stages.generate_rollouts:generate_rollouts",
            inputs=(POLICY, "execute-tools"),  # the policy, and the earlier turns (from turn 1 on)
            features=features.GENERATE_ROLLOUTS,
            config=("generation", "task", "seed", "model.dtype"),
            derived=("device", "environment_code", "engine_version"),
            # with the worker extension the vLLM servers mtrl starts load each policy through
            code=("stages/generate_rollouts", "stages/generate_rollouts/vllm_extension", "stages/task_mix.py"),
        ),
        Stage(
            name="execute-tools",
            function="stages.execute_tools:execute_tools",
            inputs=("generate-rollouts",),
            features=features.EXECUTE_TOOLS,
            config=("tools", "task", "generation"),
            derived=("environment_code",),  # environments decide observations and termination
            code=("stages/execute_tools",),
            distributed=True,
            rerun_from="generate-rollouts",
        ),
        Stage(
            name="assign-rewards",
            function="stages.assign_rewards:assign_rewards",
            inputs=("execute-tools",),  # the last turn's version; it names the earlier ones
            features=features.ASSIGN_REWARDS,
            config=("reward",),
            derived=("environment_code",),  # environments score the rollouts
            code=("stages/assign_rewards.py",),
            distributed=True,
            rerun_from="execute-tools",
        ),
        Stage(
            name="compute-advantages",
            function="stages.compute_advantages:compute_advantages",
            # the policy's critic (estimators that need values), the reference policy (a KL penalty)
            inputs=("assign-rewards", POLICY, f"{POLICY}#reference"),
            features=features.COMPUTE_ADVANTAGES,
            config=(
                "advantage",
                "ppo.kl_coef",
                "ppo.kl_estimator",
                "ppo.kl_in",
                "ppo.share_prefix",
                "generation.temperature",
            ),
            derived=("device",),
            code=("stages/compute_advantages.py",),
            rerun_from="assign-rewards",
        ),
        Stage(
            name="ppo-update",
            function="stages.ppo_update:optimise_policy",
            inputs=("compute-advantages", POLICY),
            features=features.PPO_UPDATE,
            config=("ppo", "seed", "generation.temperature"),
            # The world size decides each rank's share and the order gradients are summed in, so it is
            # hashed; the nodes only decide which machine runs which rank: the same ranks compute the
            # same things, as the runner's choice of process does for tools (tested equal within
            # float rounding: tests/test_distributed.py). A collective's timeout only decides when a
            # hung job fails: what a finished one computed does not depend on it.
            # ppo.max_staleness only picks the inputs (which policy generated, which one trains), and
            # both are parents: an update of the same rollouts and policy is the same update.
            placement=("ppo.nodes", "ppo.collective_timeout_s", "ppo.max_staleness"),
            derived=("device", "fresh_optimizer"),
            # the update and, with ppo.world_size > 1, the worker each rank runs (the launcher that
            # decides where they run is pipeline/launch.py, as ppo.nodes is placement)
            code=("stages/ppo_update",),
            rerun_from="compute-advantages",
            writes_policy=True,
        ),
        Stage(
            name="sft",
            function="stages.sft:supervised_fine_tune",
            inputs=(POLICY,),  # the imported starting policy
            features=features.SFT,
            # enable_thinking shapes the demonstrations' tokens, as it shapes a rollout's
            config=("sft", "seed", "generation.enable_thinking"),
            derived=("device", "sft_task"),
            code=("stages/sft.py",),
            writes_policy=True,
        ),
    )
}
