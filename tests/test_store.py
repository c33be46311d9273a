"""The versioned store: content-addressed versions, atomic writes, no overwrites, digests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import datasets
import pytest

from pipeline.store.versions import Store, StoreError
from runtime.hashing import version_key
from schemas import features
from schemas.config import RunConfig
from schemas.manifest import Manifest
from stages.ppo_update import PPOSettings


def write_toy(store: Store, stage: str, version: str, values: list[int], manifest: dict | None = None) -> Manifest:
    """A version holding a toy dataset (the stage schemas are tested elsewhere)."""

    def fill(folder):
        datasets.Dataset.from_dict({"x": values}).save_to_disk(str(folder))
        return {"rows": len(values)}

    return store.write(stage, version, fill, manifest or {"parents": {}})


def test_version_is_a_content_hash_of_stage_code_config_and_parents():
    base = version_key("compute-advantages", "c1", {"a": 1}, {"assign-rewards": "v1"})
    assert base == version_key("compute-advantages", "c1", {"a": 1}, {"assign-rewards": "v1"})
    assert base != version_key("compute-advantages", "c2", {"a": 1}, {"assign-rewards": "v1"})
    assert base != version_key("compute-advantages", "c1", {"a": 2}, {"assign-rewards": "v1"})
    assert base != version_key("compute-advantages", "c1", {"a": 1}, {"assign-rewards": "v2"})
    assert base != version_key("ppo-update", "c1", {"a": 1}, {"assign-rewards": "v1"})


def test_config_types_are_normalised_before_hashing():
    # {"lr": 1} and {"lr": 1.0} would hash differently; pydantic normalises them, in the run
    # config and in a stage's settings resolved from a raw run config (its JSON dump).
    one = PPOSettings.resolve(RunConfig().with_overrides({"ppo.learning_rate": 1}))
    one_float = PPOSettings.resolve(RunConfig().with_overrides({"ppo.learning_rate": 1.0}))
    assert version_key("s", "c", one.hashed(), {}) == version_key("s", "c", one_float.hashed(), {})
    raw_int, raw_float = RunConfig().model_dump(mode="json"), RunConfig().model_dump(mode="json")
    raw_int["ppo"]["learning_rate"], raw_float["ppo"]["learning_rate"] = 1, 1.0
    from_int, from_float = PPOSettings.resolve(raw_int), PPOSettings.resolve(raw_float)
    assert version_key("s", "c", from_int.hashed(), {}) == version_key("s", "c", from_float.hashed(), {})
    assert version_key("s", "c", from_int.hashed(), {}) == version_key("s", "c", one.hashed(), {})


def test_a_dataset_must_match_its_stage_schema(tmp_path):
    with pytest.raises(StoreError, match="features differ"):
        Store(tmp_path).write_dataset(
            "assign-rewards", "v1", datasets.Dataset.from_dict({"x": [1]}), {}, features.ASSIGN_REWARDS
        )
    assert not (tmp_path / "assign-rewards" / "v1").exists()


def test_write_is_atomic_and_never_overwrites(tmp_path):
    store = Store(tmp_path)
    first = write_toy(store, "assign-rewards", "v1", [1, 2], {"parents": {}})
    assert store.exists("assign-rewards", "v1")
    assert store.load("assign-rewards", "v1")["x"] == [1, 2]
    again = write_toy(store, "assign-rewards", "v1", [9, 9, 9], {"parents": {}})
    assert again.created_at == first.created_at  # untouched
    assert store.load("assign-rewards", "v1")["x"] == [1, 2]
    assert [p.name for p in (tmp_path / "assign-rewards").iterdir()] == ["v1"]


def test_a_failing_write_leaves_nothing(tmp_path):
    store = Store(tmp_path)

    def fill(folder):
        (folder / "half-written.arrow").write_bytes(b"x" * 100)
        raise RuntimeError("crash in the middle of a stage")

    with pytest.raises(RuntimeError):
        store.write("execute-tools", "v1", fill, {"parents": {}})
    assert not store.exists("execute-tools", "v1")
    assert list((tmp_path / "execute-tools").iterdir()) == []


def test_a_killed_writer_leaves_only_a_hidden_temporary_folder_that_is_cleaned(tmp_path):
    script = (
        "import os, sys; from pipeline.store.versions import Store\n"
        "def fill(folder):\n"
        "    (folder / 'data.arrow').write_bytes(b'x')\n"
        "    os.kill(os.getpid(), 9)\n"
        f"Store({str(tmp_path)!r}).write('generate-rollouts', 'v1', fill, {{'parents': {{}}}})\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=os.environ.copy())
    assert result.returncode == -9
    store = Store(tmp_path)
    leftovers = list((tmp_path / "generate-rollouts").iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".")
    assert not store.exists("generate-rollouts", "v1") and store.versions() == []
    assert store.clean_stale_tmp() == leftovers
    assert list((tmp_path / "generate-rollouts").iterdir()) == []


def killed_writer(runs_dir, version: str, hostname: str | None = None) -> None:
    """A process that dies (SIGKILL) while writing `version`, on this machine or, with
    `hostname`, as if it ran on another node of a cluster sharing the filesystem."""
    pretend = f"import socket; socket.gethostname = lambda: {hostname!r}\n" if hostname else ""
    script = pretend + (
        "import os; from pipeline.store.versions import Store\n"
        "def fill(folder):\n"
        "    os.kill(os.getpid(), 9)\n"
        f"Store({str(runs_dir)!r}).write('generate-rollouts', {version!r}, fill, {{'parents': {{}}}})\n"
    )
    assert subprocess.run([sys.executable, "-c", script], env=os.environ.copy()).returncode == -9


def test_only_this_hosts_dead_writers_lose_their_temporary_folders(tmp_path):
    """On a filesystem shared by a Ray cluster, a pid that does not exist here may be a live
    writer on another node: its folder stays (until it is a day old). Here, a dead pid's goes."""
    store = Store(tmp_path)
    killed_writer(tmp_path, "other-node", hostname="node-2.cluster")  # its pid does not exist here
    killed_writer(tmp_path, "dead-here")
    folder = tmp_path / "generate-rollouts"
    (other_node,) = folder.glob(".tmp-other-node-*")
    (dead_here,) = folder.glob(".tmp-dead-here-*")
    removed_during_a_live_write = []

    def fill(tmp):  # a writer of this host that is alive: the test process itself
        removed_during_a_live_write.extend(store.clean_stale_tmp())
        assert tmp.is_dir()
        return {}

    store.write("generate-rollouts", "live-here", fill, {"parents": {}})
    assert other_node.is_dir()
    assert removed_during_a_live_write == [dead_here]
    assert store.exists("generate-rollouts", "live-here")

    day_old = time.time() - 24 * 3600 - 60
    os.utime(other_node, (day_old, day_old))
    assert store.clean_stale_tmp() == [other_node]
    assert sorted(p.name for p in folder.iterdir()) == ["live-here"]


def test_temporary_folders_of_older_mtrl_count_as_this_hosts(tmp_path):
    store = Store(tmp_path)
    folder = tmp_path / "assign-rewards"
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout
    dead = folder / f".tmp-0123456789abcdef-{int(dead_pid)}-1a2b3c4d"  # `.tmp-<version>-<pid>-<random>`
    live = folder / f".tmp-fedcba9876543210-{os.getpid()}-1a2b3c4d"
    dead.mkdir(parents=True)
    live.mkdir()
    assert store.clean_stale_tmp() == [dead]
    assert live.is_dir()


def test_manifest_records_lineage_and_digests_detect_edits(tmp_path):
    store = Store(tmp_path)
    write_toy(store, "assign-rewards", "a1", [1], {"parents": {}, "config": {"k": 1}})
    write_toy(store, "compute-advantages", "b1", [2], {"parents": {"assign-rewards": "a1"}})
    manifest = store.manifest("compute-advantages", "b1")
    assert {"stage", "version", "parents", "created_at", "rows", "files", "library_versions"} <= set(
        manifest.model_dump()
    )
    assert [m.version for m in store.lineage("compute-advantages", "b1")] == ["b1", "a1"]
    assert store.verify("compute-advantages", "b1") == []
    shard = next(p for p in store.path("compute-advantages", "b1").glob("*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, which load_from_disk would not notice
    shard.write_bytes(bytes(data))
    assert any("differs from its digest" in problem for problem in store.verify("compute-advantages", "b1"))


def test_lineage_of_a_chain_deeper_than_the_recursion_limit_and_an_ancestor_read_lazily(tmp_path):
    """A long run's chain of versions is thousands deep (50 turns are 100 versions per
    iteration): lineage() walks it without recursion, and ancestor() reads only the manifests
    up to the one it looks for, not the whole history."""
    store = Store(tmp_path)

    def write(stage: str, version: str, parents: dict[str, str]) -> None:
        store.write(stage, version, lambda folder: (folder / "x").write_text("x") and {}, {"parents": parents})

    write("policy", "p0", {})
    for turn in range(150):
        previous = {"execute-tools": f"e{turn - 1}"} if turn else {}
        write("generate-rollouts", f"g{turn}", {"policy": "p0", **previous})
        write("execute-tools", f"e{turn}", {"generate-rollouts": f"g{turn}"})

    # depth first, parents in their stored order (by stage name), each version once
    expected = [version for turn in range(149, -1, -1) for version in (f"e{turn}", f"g{turn}")] + ["p0"]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(250)  # below the chain's depth (300)
    try:
        assert [m.version for m in store.lineage("execute-tools", "e149")] == expected
    finally:
        sys.setrecursionlimit(limit)

    read = []
    manifest = store.manifest
    store.manifest = lambda stage, version: read.append(version) or manifest(stage, version)
    assert store.ancestor("execute-tools", "e149", "generate-rollouts").version == "g149"
    assert read == ["e149", "g149"]


def test_resolve_accepts_unique_prefixes_and_names_problems(tmp_path):
    store = Store(tmp_path)
    write_toy(store, "assign-rewards", "abc123", [1], {"parents": {}})
    write_toy(store, "assign-rewards", "abd456", [1], {"parents": {}})
    assert store.resolve("assign-rewards/abc") == ("assign-rewards", "abc123")
    with pytest.raises(StoreError, match="2 versions"):
        store.resolve("assign-rewards/ab")
    with pytest.raises(StoreError, match="unknown stage|not STAGE/VERSION"):
        store.resolve("rewards/abc")
    assert json.loads((store.path("assign-rewards", "abc123") / "manifest.json").read_text())["rows"] == 1


def test_an_edited_policy_is_never_loaded(tmp_path):
    """policy_dir checks a policy's files against its digests before anything loads them."""

    store = Store(tmp_path / "runs")

    def weights(tmp):
        (tmp / "model.safetensors").write_bytes(b"weights" * 100)
        return {}

    store.write("policy", "trained", weights, {"iteration": 0})
    assert store.policy_dir("trained") == store.path("policy", "trained")
    with (store.path("policy", "trained") / "model.safetensors").open("ab") as handle:
        handle.write(b"!")  # truncated or edited weights look just like this
    with pytest.raises(StoreError, match=r"policy/trained .* model.safetensors differs from its digest"):
        store.policy_dir("trained")
