"""Content hashes: version keys, file digests, and the source files a module's code depends on.

A stored version's name is a hash of what made it (version_key); its manifest records a digest
of every file it holds (file_digests); a stage's code version hashes the source files its code
imports, followed through the packages that may shape its output (module_closure).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

VERSION_CHARS = 16
MANIFEST = "manifest.json"  # beside the files of a stored version; not among its digests
# Libraries whose versions shape a stage's bytes, hashed into every version: transformers renders
# chat templates and runs the model, tokenizers tokenizes, torch computes, datasets and pyarrow
# write the rows, numpy computes advantages, safetensors stores weights. Prefect, Ray and pydantic
# only orchestrate and validate: left out, so upgrading them keeps the cache. A manifest records
# these and the two that wrote it (library_versions), once.
SHAPING_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "pyarrow", "numpy", "safetensors")
WRITING_LIBRARIES = ("prefect", "mtrl")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, default=str)


def version_key(stage: str, code_version: str, config: dict[str, Any], parents: dict[str, str]) -> str:
    """Content hash naming a stored version; configs are JSON-normalised by pydantic first."""
    payload = {"stage": stage, "code_version": code_version, "config": config, "parents": parents}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:VERSION_CHARS]


def file_digest(path: Path) -> dict[str, Any]:
    """Size and xxh3-128 of one file."""
    hasher = xxhash.xxh3_128()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(block)
    return {"bytes": path.stat().st_size, "xxh3_128": hasher.hexdigest()}


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and xxh3-128 of every file under `folder` (the manifest aside), by relative path."""
    return {
        str(path.relative_to(folder)): file_digest(path)
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    }


def digest_problems(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """The files that are missing, unexpected, or differ from their recorded digest."""
    problems = [f"missing file {name}" for name in expected if name not in actual]
    problems += [f"unexpected file {name}" for name in actual if name not in expected]
    problems += [
        f"{name} differs from its digest" for name in expected if name in actual and actual[name] != expected[name]
    ]
    return problems


def source_version(*paths: str | Path) -> str:
    """A short hash of the contents of these files."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:VERSION_CHARS]


def module_closure(entries: list[Path], root: Path, packages: tuple[str, ...]) -> list[Path]:
    """These source files and the files of `packages` (top-level package names under `root`)
    that they import, transitively, imports inside functions included; sorted."""
    seen: set[Path] = set()
    todo = list(entries)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += imported_files(path, root, packages)
    return sorted(seen)


def _runs(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a module, less the blocks under `if TYPE_CHECKING:` (imports for type hints
    only: they never run, so they shape nothing)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
    return found


@functools.cache  # closures share most of their files: each is parsed once per process
def imported_files(path: Path, root: Path, packages: tuple[str, ...]) -> list[Path]:
    """The source files of `packages` that this one imports (absolute imports; not those under
    `if TYPE_CHECKING:`)."""
    imported = []
    for node in _runs(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name.split(".")[0] in packages:
                module = root / name.replace(".", "/")
                imported += [f for f in (module / "__init__.py", module.with_suffix(".py")) if f.is_file()]
    return imported


@functools.cache  # a process runs with one set of libraries; each lookup scans the installed packages
def package_version(name: str) -> str | None:
    """The installed version of a distribution, None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library_versions(names: tuple[str, ...] = SHAPING_LIBRARIES + WRITING_LIBRARIES) -> dict[str, str]:
    """Python's version and these libraries': what a manifest records (all of them) and what a
    version hashes (the shaping ones)."""
    return {"python": platform.python_version(), **{n: package_version(n) or "absent" for n in names}}
