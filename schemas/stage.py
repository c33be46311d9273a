"""A stage is one contract (docs/architecture.md): each stage declares one `Stage` in its own module,
and pipeline/orchestration/stage_table.py registers it with one line. Everything else is derived from the
declarations: the store's folders, the Prefect task, the inputs a run finds through the lineage,
`mtrl stage`, the version.

    STAGE = Stage(
        name="assign-rewards",
        inputs=("execute-tools",),        # the stored versions it reads (its manifest's parents)
        features=features.ASSIGN_REWARDS,  # the Arrow schema of its dataset
        settings=Settings,                 # exactly the run-config fields its code reads
        run=run,                           # run(inputs, settings, **position) -> Output
        rerun_from="execute-tools",        # `mtrl stage assign-rewards --from execute-tools/VERSION`
    )

A stage's version hashes its settings, its code (its module and what it imports of stages/ and
schemas/) and its inputs' versions: nothing else re-keys it, and nothing that shapes its bytes
escapes it. Its settings are a frozen model whose every field names the run-config field it comes
from (`read`), resolved in one place (`Settings.resolve`); the run config's own module
(schemas/config.py: help texts, every other stage's fields) is in no stage's code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import datasets
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # a manifest is bookkeeping: editing it versions nothing
    from schemas.manifest import Manifest

POLICY = "policy"  # the other kind of stored version: a checkpoint written by a stage that trains


def read(*paths: str, placement: bool = False) -> Any:
    """A settings field that holds the run-config field at this dotted path (with several paths:
    the first of them that is not null, e.g. read("sft.task", "task.name")). `placement`: the field
    only says where the stage runs or how long it may wait, not what it computes (a server's URL, a
    timeout that fails a hung job, worker threads): left out of the version."""
    return Field(json_schema_extra={"read": list(paths), "placement": placement})


def _declared(info: Any) -> dict[str, Any]:
    """What `read` declared of a settings field ({} for a field it did not make)."""
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _config_value(config: Mapping[str, Any], paths: list[str]) -> Any:
    value = None
    for path in paths:
        value = functools.reduce(lambda node, key: node[key], path.split("."), config)
        if value is not None:
            return value
    return value


class Settings(BaseModel):
    """The run-config fields a stage's code reads, and only those, frozen. Each field says where it
    comes from (`read`); a field whose type is itself Settings (a part shared by several stages, e.g.
    the task mix) is resolved the same way; derived values (the code of a plugin's environment, the
    device `auto` picks) are computed fields or validators of the model, so they are hashed too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def resolve(cls, config: BaseModel | Mapping[str, Any]) -> Self:
        """These settings of a run config (a RunConfig, or its JSON dump)."""
        values = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
        return cls.model_validate(cls._fields_of(values))

    @classmethod
    def _fields_of(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        found = {}
        for name, info in cls.model_fields.items():
            if "read" in _declared(info):
                found[name] = _config_value(config, _declared(info)["read"])
            elif isinstance(info.annotation, type) and issubclass(info.annotation, Settings):
                found[name] = info.annotation._fields_of(config)
        return found

    def hashed(self) -> dict[str, Any]:
        """What a version hashes and its manifest records: every field, computed ones included,
        JSON-normalised, less the placement fields (at every level)."""
        dumped = self.model_dump(mode="json")
        for name, info in type(self).model_fields.items():
            if _declared(info).get("placement"):
                del dumped[name]
            elif isinstance(value := getattr(self, name), Settings):
                dumped[name] = value.hashed()
        return dumped

    def to_json(self) -> str:
        """The settings as JSON that `model_validate_json` reads back (computed fields left out)."""
        return self.model_dump_json(exclude_computed_fields=True)


class Inputs(Protocol):
    """What a stage reads of the store: its inputs, by name (e.g. "execute-tools", "policy"), each a
    stored version its manifest records as a parent. Every read is checked against the version's
    file digests. Implemented by the pipeline (pipeline/orchestration/stage_runs.py)."""

    version: str  # the version this run writes
    parents: Mapping[str, str]  # input name -> version

    def load(self, name: str) -> datasets.Dataset:
        """An input's dataset."""
        ...

    def folder(self, name: str) -> Path:
        """An input's folder (a policy checkpoint), its files checked."""
        ...

    def manifest(self, name: str) -> Manifest:
        """An input's manifest."""
        ...

    def turns(self, name: str) -> datasets.Dataset:
        """Every turn of an iteration, in one dataset, up to the execute-tools version of input
        `name`: the whole iteration's view, built once where a stage needs it (rewards)."""
        ...

    def generating_policy(self, name: str) -> Manifest:
        """The policy that generated the rollouts an input was computed from."""
        ...

    def scratch(self) -> Path:
        """A new work folder inside the store (every node of a cluster sees it), removed once the
        stage's output is written."""
        ...


@dataclass
class Output:
    """What a stage's run returns: its dataset, its own manifest fields (metrics, provenance, ...)
    and, for a stage that trains, `save_policy(folder) -> manifest fields`, which writes the
    policy it trained (stored as the policy version that this version names)."""

    dataset: datasets.Dataset
    manifest: dict[str, Any] = field(default_factory=dict)
    save_policy: Callable[[Path], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    # The stored versions it may read (its manifest's parents), or a function of its settings that
    # says which (compute-advantages reads a critic and a KL reference only when it uses them).
    inputs: tuple[str, ...] | Callable[[Any], tuple[str, ...]]
    features: datasets.Features  # the Arrow schema of its dataset
    settings: type[Settings]
    run: Callable[..., Output]  # run(inputs: Inputs, settings, **position) -> Output
    rerun_from: str | None = None  # `mtrl stage NAME --from STAGE/VERSION` re-runs it on this input
    distributed: bool = False  # may run as a Ray task (runner.kind=ray); generation and training hold a model
    writes_policy: bool = False  # its output is its metrics and the policy it trained (Output.save_policy)
    audits: str | None = None  # the input the audit checks before it runs: never train on a bad batch
    # For a stage that continues the AdamW state of its policy input (when its settings say so):
    # retention may have pruned that state (pipeline/store/retention.py).
    continues_optimizer: Callable[[Any], bool] | None = None
    code: tuple[str, ...] = ()  # hashed source its module does not import (a plugin another process loads)

    def input_names(self, settings: Settings) -> tuple[str, ...]:
        return self.inputs(settings) if callable(self.inputs) else self.inputs
