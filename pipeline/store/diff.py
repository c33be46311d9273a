"""`mtrl diff RUNS_A RUNS_B`: do two runs directories hold the same data, version names aside?

Versions name code and config, so the same data made by different code has other versions.
This compares what is stored: every dataset matched by (stage, iteration, turn), column by
column (all but `policy_version`, which holds a version name), and every policy matched by
iteration, tensor by tensor (weights, AdamW state, value head; an AdamW state that retention
pruned on either side is named, not compared). Use it to check that a refactor, another
machine or another runner changed nothing.
"""

from __future__ import annotations

from pathlib import Path

import datasets
from safetensors.numpy import load_file

from pipeline.store.versions import Store, StoreError
from runtime.hashing import MANIFEST
from schemas.manifest import Manifest
from schemas.stage import POLICY

Key = tuple[str, int | None, int | str | None]  # stage, iteration, turn (a policy: what made it)


def stored_items(store: Store) -> dict[Key, Path]:
    """Every version of a runs directory by what it holds, not by its version name."""
    items: dict[Key, Path] = {}
    for manifest in store.versions():
        stage, path, iteration = manifest.stage, store.path(manifest.stage, manifest.version), manifest.iteration
        if stage != POLICY:
            rows = datasets.load_from_disk(str(path))
            if "iteration" in rows.column_names:  # rows of turns know theirs
                iteration = rows[0]["iteration"] if len(rows) else None
        # a turn for the per-turn stages; for a policy the stage that trained it, since the imported
        # model and its warm start (sft) are both of iteration -1
        made_by = next(iter(manifest.parents), "imported")
        key = (stage, iteration, made_by if stage == POLICY else manifest.turn)
        if key in items:
            raise StoreError(f"{store.root} holds two versions of {key}: compare runs of one configuration")
        items[key] = path
    return items


def same_dataset(left: Path, right: Path) -> tuple[bool, str]:
    a, b = datasets.load_from_disk(str(left)), datasets.load_from_disk(str(right))
    if a.features != b.features or len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} rows, features {'equal' if a.features == b.features else 'differ'}"
    columns = [name for name in a.column_names if name != "policy_version"]
    differ = [name for name in columns if a.data.table.column(name) != b.data.table.column(name)]
    return not differ, f"{len(a)} rows x {len(columns)} columns" + (f", differ: {differ}" if differ else "")


def same_policy(left: Path, right: Path) -> tuple[bool, str]:
    """The safetensors files both policies were written with, tensor by tensor; those that
    retention pruned on either side (AdamW state) are named in the detail, not compared."""
    manifests = [Manifest.model_validate_json((folder / MANIFEST).read_text()) for folder in (left, right)]
    written = [{name for name in m.files if name.endswith(".safetensors")} for m in manifests]
    if written[0] != written[1]:
        return False, "different files"
    pruned = sorted(name for name in written[0] if any(name in m.pruned for m in manifests))
    files = sorted(written[0] - set(pruned))
    tensors, differ = 0, []
    for name in files:
        a, b = load_file(left / name), load_file(right / name)
        tensors += len(a)
        if a.keys() != b.keys() or any(a[k].dtype != b[k].dtype or not (a[k] == b[k]).all() for k in a):
            differ.append(name)
    detail = f"{tensors} tensors in {files}" + (f", pruned, not compared: {pruned}" if pruned else "")
    return not differ, detail + (f", differ: {differ}" if differ else "")


def compare_runs(left: str | Path, right: str | Path) -> tuple[list[str], int]:
    """One line per compared item ('same' or 'DIFFERENT'), and how many differ."""
    a, b = stored_items(Store(left)), stored_items(Store(right))
    lines, different = [], 0
    for key in sorted(a.keys() ^ b.keys(), key=str):
        lines.append(f"DIFFERENT  {key}  only in {left if key in a else right}")
        different += 1
    for key in sorted(a.keys() & b.keys(), key=str):
        same, detail = (same_policy if key[0] == POLICY else same_dataset)(a[key], b[key])
        lines.append(f"{'same' if same else 'DIFFERENT'}  {key}  {detail}")
        different += not same
    lines.append(f"{len(a.keys() | b.keys())} items compared, {different} different")
    return lines, different
