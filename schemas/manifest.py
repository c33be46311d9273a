"""The manifest.json written beside every stored version (see docs/store.md).

Every version records where it came from (its parents, the settings its version hashes and the
run config it was made with), what it holds and how long it took. Stages add their own fields (metrics, provenance,
audit results, ...): they are kept as extra fields and shown by `mtrl show`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StoreError(RuntimeError):
    """A missing, corrupted or ambiguous version (defined here, with nothing heavy imported, so
    that the CLI can catch it before it imports the store)."""


class MissingVersionError(StoreError):
    """A version that is not in the store (the CLI adds how to rebuild it: pipeline/store/lineage.py)."""

    def __init__(self, stage: str, version: str, root: Path):
        super().__init__(f"{stage}/{version} is not in the store at {root}")
        self.stage, self.version, self.root = stage, version, root


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    stage: str
    version: str
    parents: dict[str, str] = Field(default_factory=dict)  # input stage -> version ("policy#reference": the KL's)
    settings: dict[str, Any] = Field(default_factory=dict)  # the stage's settings its version hashes
    config: dict[str, Any] = Field(default_factory=dict)  # the run config it was made with (`mtrl stage` reuses it)
    code_version: str = ""
    created_at: str
    iteration: int | None = None
    turn: int | None = None
    rows: int | None = None  # dataset rows (none for a policy)
    tokens: dict[str, int] = Field(default_factory=dict)  # context / completion / observation tokens
    wall_s: float | None = None  # computing it
    write_s: float | None = None  # storing it
    metrics: dict[str, Any] = Field(default_factory=dict)
    active: int | None = None  # execute-tools: rollouts still going on after this turn
    policy: str | None = None  # ppo-update: the policy version it wrote
    imported_from: str | None = None  # the base policy: the folder its files were copied from, or the GGUF file
    files: dict[str, dict[str, Any]] = Field(default_factory=dict)  # relative path -> bytes and xxh3 digest
    # files retention deleted (relative path -> bytes, when, why); `files` still holds what was written
    pruned: dict[str, dict[str, Any]] = Field(default_factory=dict)
    library_versions: dict[str, str] = Field(default_factory=dict)

    def extra(self, name: str, default: Any = None) -> Any:
        """A stage's own field (e.g. "replay", "audit", "provenance")."""
        return (self.model_extra or {}).get(name, default)

    def kept_files(self) -> dict[str, dict[str, Any]]:
        """The digests of the files that should be on disk: those written, less those pruned."""
        return {name: digest for name, digest in self.files.items() if name not in self.pruned}
