"""The versioned store: one folder per (stage, version), written atomically, never overwritten
(see docs/store.md).

    <runs_dir>/<stage>/<version>/   a datasets.Dataset (save_to_disk) + manifest.json
    <runs_dir>/policy/<version>/    a save_pretrained checkpoint + manifest.json

A version is a content hash of the stage name, the stage's code version, its config and
the versions of its inputs: same inputs and config give the same version (a cache hit);
anything else gives a new folder beside the old ones. A folder is written under a hidden
temporary name in the same directory and renamed into place only when complete, so a crash
never leaves a half-written version that a later run could mistake for a finished one; the
temporary name says which host and process writes it, so a later run removes only what a dead
writer left behind.
The manifest records a digest of every file, so edited or corrupted versions are detected.
Retention (pipeline/store/retention.py) may later delete files only continuing training needs (a
policy's AdamW state): the manifest says so first (`pruned`), and the digests are checked for
the files it keeps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import datasets

from runtime.hashing import MANIFEST, digest_problems, file_digests, library_versions
from runtime.phases import PHASES
from runtime.processes import pid_alive
from schemas.manifest import Manifest, MissingVersionError, StoreError
from schemas.stage import POLICY

# datasets writes cache files (map, cast, flatten_indices, ...) next to the data a dataset was
# loaded from, i.e. *into a finished version folder*. Our stages never need that cache.
datasets.disable_caching()

STAGE_NAME = re.compile(r"[a-z][a-z0-9-]*")  # a stage's folder (the stages' names, and "policy")
TMP_PREFIX = ".tmp-"
# A writer holds its temporary folder only while it saves one finished version (seconds to
# minutes), so a folder untouched for a day is stale whoever wrote it (a reused pid, a host
# that went away).
TMP_MAX_AGE_S = 24 * 3600


def copy_files(source: Path, target: Path, files: dict[str, Any]) -> None:
    """Copy these files of `source` into `target`. Copies, not hard links: a link shares its
    bytes, and a `save_pretrained` into the source folder would then rewrite the store's copy."""
    for name in files:
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, destination)  # follows a hub snapshot's symlinks to its blobs


# Policy folders whose digests matched, by their files' (path, size, mtime): a memo of this process, so that a
# policy every stage of an iteration loads is hashed once (a file changed since has another size or mtime).
_VERIFIED: set[tuple] = set()


def manifest_text(fields: dict[str, Any]) -> str:
    """The text of a manifest.json (written whole, replaced whole)."""
    return json.dumps(fields, indent=2, sort_keys=True, default=str) + "\n"


def _delete_pruned(folder: Path, manifest: Manifest) -> None:
    """Delete the files the manifest calls pruned that are still in the version's folder."""
    left = [folder / name for name in manifest.pruned if (folder / name).exists()]
    for path in left:
        path.unlink(missing_ok=True)
    if left:
        _fsync_dir(folder)


def _policy_problems(folder: Path, manifest: Manifest) -> list[str]:
    """A policy folder's files against its manifest (store.policy_dir); a folder that matched
    is not hashed again in this process while its files keep their sizes and times."""
    # a prune that died between its two steps left files its manifest calls pruned: they go
    # before anything loads the folder (an AdamW state thought gone must not continue)
    _delete_pruned(folder, manifest)
    try:
        stats = tuple(
            (str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()
        )
        if stats in _VERIFIED:
            return []
        problems = digest_problems(manifest.kept_files(), file_digests(folder))
    except FileNotFoundError as gone:  # deleted between the listing and its reading
        return [f"missing file {Path(gone.filename or '?').name}"]
    if not problems:
        _VERIFIED.add(stats)
    return problems


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def this_host() -> str:
    """This machine's name as temporary folder names hold it: a file name's characters only,
    never '@' (it separates the writer's pid from its host)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]


def tmp_folder_name(version: str) -> str:
    """`.tmp-<version>-<random>-<pid>@<host>`: a folder of a shared filesystem (a Ray cluster)
    names the machine whose process writes it, since a pid means something only there."""
    return f"{TMP_PREFIX}{version}-{uuid.uuid4().hex[:8]}-{os.getpid()}@{this_host()}"


def tmp_folder_writer(name: str) -> tuple[str | None, int] | None:
    """(host, pid) of the process writing a temporary folder. The host is None for the older
    name `.tmp-<version>-<pid>-<random>` (older mtrl, one machine). None: not a temporary name."""
    head, at, host = name.rpartition("@")
    try:
        if at:
            return host, int(head.rsplit("-", 1)[1])
        return None, int(name.split("-")[-2])
    except (IndexError, ValueError):
        return None


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    # ------------------------------------------------------------------ reading

    def stages(self) -> list[str]:
        """The stages (and "policy") this runs directory holds versions of."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name for entry in self.root.iterdir() if entry.is_dir() and STAGE_NAME.fullmatch(entry.name)
        )

    def path(self, stage: str, version: str) -> Path:
        if not STAGE_NAME.fullmatch(stage):
            raise StoreError(f"'{stage}' is not a stage's name (lowercase letters, digits and '-')")
        return self.root / stage / version

    def exists(self, stage: str, version: str) -> bool:
        return (self.path(stage, version) / MANIFEST).is_file()

    def manifest(self, stage: str, version: str) -> Manifest:
        path = self.path(stage, version) / MANIFEST
        if not path.is_file():
            raise MissingVersionError(stage, version, self.root)
        return Manifest.model_validate_json(path.read_text())

    @PHASES.timed("store_reads")
    def load(self, stage: str, version: str, verify: bool = True) -> datasets.Dataset:
        """The dataset of a version; its files are checked against the manifest's digests first
        (xxh3 runs at several GB/s), so an edited or corrupted version is never used silently."""
        self.manifest(stage, version)  # raises a clear error when missing
        if verify:
            problems = self.verify(stage, version)
            if problems:
                raise StoreError(f"{stage}/{version} is corrupted or was edited: {'; '.join(problems)}")
        return datasets.load_from_disk(str(self.path(stage, version)))

    def policy_dir(self, version: str) -> Path:
        """Directory to load a policy from (its folder in the store), after its files were
        checked against the digests recorded when it was written or imported: edited or
        truncated weights are never loaded. A folder is hashed once per process while its files
        keep their sizes and modification times.

        A retention pass may prune the folder's AdamW state while it is checked (with
        ppo.max_staleness the batch made ahead reads a policy while the update beside it prunes
        older ones): its manifest says so before the file goes, so a check that finds a file gone
        reads the manifest again and, when it changed, checks once more against it."""
        folder = self.path(POLICY, version)
        manifest = self.manifest(POLICY, version)
        problems = _policy_problems(folder, manifest)
        if problems and (now := self.manifest(POLICY, version)).pruned != manifest.pruned:
            problems = _policy_problems(folder, now)  # a prune landed while the files were read
        if problems:
            raise StoreError(f"policy/{version} at {folder} is corrupted or was edited: {'; '.join(problems)}")
        return folder

    def versions(self, stage: str | None = None) -> list[Manifest]:
        """Manifests of the finished versions, oldest first."""
        manifests = []
        for name in [stage] if stage else self.stages():
            folder = self.root / name
            if folder.is_dir():
                for entry in folder.iterdir():
                    if not entry.name.startswith(".") and (entry / MANIFEST).is_file():
                        manifests.append(Manifest.model_validate_json((entry / MANIFEST).read_text()))
        return sorted(manifests, key=lambda m: (m.created_at, m.stage, m.version))

    def resolve(self, reference: str) -> tuple[str, str]:
        """'stage/version' (a unique version prefix is enough) -> (stage, version)."""
        stage, _, prefix = reference.strip("/").partition("/")
        if not STAGE_NAME.fullmatch(stage) or not prefix:
            raise StoreError(f"'{reference}' is not STAGE/VERSION; stages in {self.root}: {', '.join(self.stages())}")
        folder = self.root / stage
        if not folder.is_dir():
            raise StoreError(f"unknown stage '{stage}': stages in {self.root}: {', '.join(self.stages())}")
        matches = sorted(p.name for p in folder.iterdir() if p.name.startswith(prefix) and (p / MANIFEST).is_file())
        if len(matches) != 1:
            found = "no version" if not matches else f"{len(matches)} versions"
            raise StoreError(f"{found} of {stage} match '{prefix}' in {self.root}")
        return stage, matches[0]

    def lineage(self, stage: str, version: str) -> list[Manifest]:
        """This version and all its ancestors, depth first (each manifest once)."""
        return list(self.walk_lineage(stage, version))

    def walk_lineage(self, stage: str, version: str, stop_at: str | None = None) -> Iterator[Manifest]:
        """lineage(), each manifest read when it is reached: a search for a near ancestor stops
        there instead of reading the run's whole history (which grows by ~2 x turns + 5
        versions per iteration). A stack, not recursion: a long run's chain is thousands deep.
        The versions of `stop_at` are reached but their parents not followed."""
        seen: set[tuple[str, str]] = set()
        todo = [(stage, version)]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            manifest = self.manifest(*node)
            yield manifest
            if manifest.stage != stop_at:  # the first parent is visited first, as a recursive walk would
                todo += [(name.split("#")[0], parent) for name, parent in reversed(manifest.parents.items())]

    def ancestor(self, stage: str, version: str, of_stage: str) -> Manifest:
        """The nearest version of `of_stage` in a version's lineage (e.g. its rollouts')."""
        found = next((m for m in self.walk_lineage(stage, version) if m.stage == of_stage), None)
        if found is None:
            raise StoreError(f"{stage}/{version} has no {of_stage} in its lineage")
        return found

    def verify(self, stage: str, version: str) -> list[str]:
        """Problems with a version's files (empty when the files it keeps match the manifest's
        digests). A pruned file is not expected, and one that a crashed prune left is no problem."""
        manifest = self.manifest(stage, version)
        on_disk = file_digests(self.path(stage, version))
        return digest_problems(manifest.kept_files(), {k: v for k, v in on_disk.items() if k not in manifest.pruned})

    # ------------------------------------------------------------------ writing

    def write(
        self,
        stage: str,
        version: str,
        fill: Callable[[Path], dict[str, Any]],
        manifest: dict[str, Any],
        expected_files: dict[str, Any] | None = None,
    ) -> Manifest:
        """Atomically create stage/version: fill(tmp_dir) writes the files and returns extra
        manifest fields. Returns the final manifest. An existing version is never touched.
        `expected_files` (digests) rebuilds a deleted version: other bytes are refused, since
        later versions were made from the deleted ones."""
        final = self.path(stage, version)
        if self.exists(stage, version):
            return self.manifest(stage, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / tmp_folder_name(version)
        tmp.mkdir()
        started = time.time()
        try:
            extra = fill(tmp)
            full = {
                "stage": stage,
                "version": version,
                **manifest,
                **extra,
                "created_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "write_s": round(time.time() - started, 3),
                "library_versions": library_versions(),
                "files": file_digests(tmp),
            }
            problems = digest_problems(expected_files, full["files"]) if expected_files else []
            if problems:
                raise StoreError(
                    f"{stage}/{version} was deleted and computing it again gave other bytes ({'; '.join(problems)}), "
                    "so the versions made from it would not match it: on this device the computation is not "
                    "bit-reproducible. Restore the folder from a backup, or run into a new runs dir."
                )
            Manifest.model_validate(full)  # a malformed manifest fails here, before anything is published
            (tmp / MANIFEST).write_text(manifest_text(full))
            _fsync_tree(tmp)
            try:
                os.rename(tmp, final)  # atomic; fails if another writer finished first
            except OSError:
                if self.exists(stage, version):
                    shutil.rmtree(tmp, ignore_errors=True)
                    return self.manifest(stage, version)
                raise
            _fsync_dir(final.parent)
            return Manifest.model_validate(full)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # SIGKILL skips this: clean_stale_tmp() does it later
            raise

    def scratch(self, stage: str, version: str) -> Path:
        """A new work folder beside stage's versions, for the one writing `version` (every node of a
        cluster sees the store); the writer removes it, clean_stale_tmp when the writer died."""
        folder = self.root / stage / tmp_folder_name(f"{version}-work")
        folder.mkdir(parents=True)
        return folder

    def prune(self, stage: str, version: str, names: list[str], reason: str) -> Manifest:
        """Delete files of a finished version that only later work needs (retention: a policy's
        AdamW state), saying so in its manifest: `pruned` records each file's size, when and why,
        and `files` keeps what was written. The manifest is replaced first (atomically), then
        the files go, so a crash between the two leaves files the manifest already calls pruned:
        never checked, never loaded, and deleted by the next prune or load of the version.
        Pruning a file again only deletes what a crash left of it."""
        manifest = self.manifest(stage, version)
        unknown = sorted(set(names) - set(manifest.files))
        if unknown:
            raise StoreError(f"{stage}/{version} was written without {', '.join(unknown)}: nothing to prune")
        at = datetime.now(UTC).isoformat(timespec="milliseconds")
        new = {
            name: {"bytes": manifest.files[name]["bytes"], "at": at, "reason": reason}
            for name in names
            if name not in manifest.pruned
        }
        if new:
            manifest = self._replace_manifest(stage, version, {"pruned": {**manifest.pruned, **new}})
        _delete_pruned(self.path(stage, version), manifest)
        return manifest

    def _replace_manifest(self, stage: str, version: str, changes: dict[str, Any]) -> Manifest:
        """Update fields of a finished version's manifest, atomically: the new text is written and
        fsynced beside the version folders (a temporary name that clean_stale_tmp removes after a
        crash, never among the version's files), then renamed over manifest.json."""
        final = self.path(stage, version) / MANIFEST
        fields = json.loads(final.read_text()) | changes
        manifest = Manifest.model_validate(fields)  # a malformed manifest fails here, before it replaces one
        partial = final.parent.parent / tmp_folder_name(version)
        try:
            with partial.open("w") as handle:
                handle.write(manifest_text(fields))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, final)  # atomic: readers see the old manifest or the new one
        except BaseException:
            partial.unlink(missing_ok=True)  # SIGKILL skips this: clean_stale_tmp() does it later
            raise
        _fsync_dir(final.parent)
        return manifest

    @PHASES.timed("store_writes")
    def write_dataset(
        self, stage: str, version: str, dataset: datasets.Dataset, manifest: dict[str, Any], features: datasets.Features
    ) -> Manifest:
        """Atomically store a dataset as stage/version; its features must be the stage's (`features`)."""
        if dataset.features != features:
            raise StoreError(
                f"{stage}/{version}: features differ from the stage's (schemas.features): {dataset.features}"
            )

        def fill(tmp: Path) -> dict[str, Any]:
            dataset.save_to_disk(str(tmp))
            return {"rows": len(dataset), "features": list(dataset.features)}

        return self.write(stage, version, fill, manifest)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive use of the store by one training run at a time (an OS file lock, released
        when the process dies): two scheduled iterations never interleave their writes. Taking it
        removes what writers that died left (clean_stale_tmp)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self.clean_stale_tmp()
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def clean_stale_tmp(self) -> list[Path]:
        """Remove temporary folders (and the temporary files of replaced manifests) left by
        writers that died. A folder of this host goes when its writer's pid is gone; one of
        another host (a Ray node on a shared filesystem) is left alone, since this machine cannot
        see that host's processes, unless it is older than TMP_MAX_AGE_S, like any folder.
        Folders in the older naming count as this host's."""
        removed = []
        here, now = this_host(), time.time()
        for stage in self.stages():
            folder = self.root / stage
            if not folder.is_dir():
                continue
            for entry in folder.glob(f"{TMP_PREFIX}*"):
                writer = tmp_folder_writer(entry.name)
                if writer is None:
                    continue
                host, pid = writer
                try:
                    too_old = now - entry.stat().st_mtime > TMP_MAX_AGE_S
                except FileNotFoundError:  # its writer finished and renamed it meanwhile
                    continue
                if too_old or (host in (None, here) and not pid_alive(pid)):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:  # a manifest being replaced (_replace_manifest)
                        entry.unlink(missing_ok=True)
                    removed.append(entry)
        return removed
