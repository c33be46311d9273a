"""Store retention: the AdamW state of older policies is pruned (only it, only in the new
policy's lineage, the manifest saying so first), a pruned store checks clean and loads, and
a ppo-update that would continue a pruned state fails clearly unless told to start fresh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.orchestration.stage_table import POLICY
from pipeline.store.retention import PrunedStateError, optimizer_state_gone, prune_optimizer_states
from pipeline.store.versions import Store, StoreError
from stages.ppo_update.checkpoint import OPTIMIZER_FILE


def write_policy(store: Store, version: str, trained_from: str | None = None, optimizer: bool = True) -> None:
    """A policy folder with toy files: weights and, unless `optimizer` is false (the starting
    model, a LoRA update's policy), an AdamW state; `trained_from` adds the ppo-update between."""
    parents = {}
    if trained_from is not None:
        update = f"u-{version}"

        def metrics(folder: Path) -> dict:
            (folder / "data.arrow").write_bytes(b"metrics")
            return {}

        store.write("ppo-update", update, metrics, {"parents": {POLICY: trained_from}, "policy": version})
        parents = {"ppo-update": update}

    def files(folder: Path) -> dict:
        (folder / "model.safetensors").write_bytes(b"weights" * 10)
        if optimizer:
            (folder / OPTIMIZER_FILE).write_bytes(b"adam" * 20)
        return {}

    store.write(POLICY, version, files, {"parents": parents})


def pruned(store: Store) -> set[str]:
    return {m.version for m in store.versions(POLICY) if OPTIMIZER_FILE in m.pruned}


def test_a_prune_says_so_in_the_manifest_and_the_digest_check_stays_clean(tmp_path):
    store = Store(tmp_path)
    write_policy(store, "p")
    written = store.manifest(POLICY, "p").files
    manifest = store.prune(POLICY, "p", [OPTIMIZER_FILE], "a test")
    record = manifest.pruned[OPTIMIZER_FILE]
    assert record["bytes"] == 80 and record["reason"] == "a test" and record["at"]
    assert store.manifest(POLICY, "p") == manifest  # on disk
    assert manifest.files == written  # what was written stays recorded
    assert not (store.path(POLICY, "p") / OPTIMIZER_FILE).exists()
    assert store.verify(POLICY, "p") == [] and store.policy_dir("p") == store.path(POLICY, "p")
    assert store.prune(POLICY, "p", [OPTIMIZER_FILE], "again").pruned == manifest.pruned  # the first record stays
    with pytest.raises(StoreError, match="policy/p was written without value_head.safetensors"):
        store.prune(POLICY, "p", ["value_head.safetensors"], "a test")
    (store.path(POLICY, "p") / "model.safetensors").write_bytes(b"edited")  # a kept file is still checked
    assert store.verify(POLICY, "p") == ["model.safetensors differs from its digest"]


def test_a_prune_landing_while_a_policy_is_checked_is_no_corruption(tmp_path, monkeypatch):
    """With ppo.max_staleness the batch made ahead checks the policy it generates with while the
    update beside it prunes older AdamW states: a prune that lands between the check's reading of
    the manifest and of the files (injected here) is read from the manifest, not called corruption."""
    import pipeline.store.versions as store_module

    store = Store(tmp_path)
    write_policy(store, "p")
    real_digests = store_module.file_digests

    def prune_first(folder):
        monkeypatch.setattr(store_module, "file_digests", real_digests)
        store.prune(POLICY, "p", [OPTIMIZER_FILE], "retention beside the check")
        return real_digests(folder)

    monkeypatch.setattr(store_module, "file_digests", prune_first)
    assert store.policy_dir("p") == store.path(POLICY, "p")
    assert OPTIMIZER_FILE in store.manifest(POLICY, "p").pruned
    (store.path(POLICY, "p") / "model.safetensors").write_bytes(b"edited")  # an edit is still caught
    with pytest.raises(StoreError, match="model.safetensors differs from its digest"):
        store.policy_dir("p")


def killed_pruner(runs_dir: Path, version: str, kill_at: str) -> None:
    """A process that prunes a policy's AdamW state and dies (SIGKILL) at `kill_at`: the rename
    of the new manifest over the old one (os.replace), or the deletion of the file (unlink)."""
    inject = {
        "replace": "os.replace = lambda *args: os.kill(os.getpid(), 9)\n",
        "unlink": "pathlib.Path.unlink = lambda self, missing_ok=False: os.kill(os.getpid(), 9)\n",
    }[kill_at]
    script = (
        "import os, pathlib\n"
        "from pipeline.store.versions import Store\n"
        f"{inject}"
        f"Store({str(runs_dir)!r}).prune('policy', {version!r}, [{OPTIMIZER_FILE!r}], 'killed')\n"
    )
    assert subprocess.run([sys.executable, "-c", script], env=os.environ.copy()).returncode == -9


def test_a_prune_killed_at_either_step_leaves_a_store_that_checks_clean_and_loads(tmp_path):
    store = Store(tmp_path)
    write_policy(store, "before-rename")
    write_policy(store, "before-delete")

    killed_pruner(tmp_path, "before-rename", kill_at="replace")
    assert store.manifest(POLICY, "before-rename").pruned == {}  # the old manifest, whole
    assert (store.path(POLICY, "before-rename") / OPTIMIZER_FILE).is_file()
    assert store.verify(POLICY, "before-rename") == []
    (partial,) = (tmp_path / POLICY).glob(".tmp-*")  # the new manifest's text, beside the version folders
    assert store.clean_stale_tmp() == [partial] and not partial.exists()

    killed_pruner(tmp_path, "before-delete", kill_at="unlink")
    left = store.path(POLICY, "before-delete") / OPTIMIZER_FILE
    assert OPTIMIZER_FILE in store.manifest(POLICY, "before-delete").pruned and left.is_file()
    assert store.verify(POLICY, "before-delete") == []  # a file the manifest calls pruned is no problem
    assert store.policy_dir("before-delete") == left.parent and not left.exists()  # loading finishes the prune


def test_retention_prunes_the_older_states_of_the_new_policys_lineage_only(tmp_path):
    """base -> p0 -> ... -> p4, with p2 a LoRA update's policy (no AdamW state), and a branch
    q3 of another run trained from p2: pruning after p4 keeps p4 and p3's state, leaves the
    base and the branch alone, and prunes the rest oldest first."""
    store = Store(tmp_path)
    write_policy(store, "base", optimizer=False)
    previous = "base"
    for k in range(5):
        write_policy(store, f"p{k}", trained_from=previous, optimizer=k != 2)
        previous = f"p{k}"
    write_policy(store, "q3", trained_from="p2")

    assert prune_optimizer_states(store, "p4", keep=2) == ["p0", "p1"]
    assert pruned(store) == {"p0", "p1"}
    assert all(store.verify(POLICY, m.version) == [] for m in store.versions(POLICY))
    reason = store.manifest(POLICY, "p0").pruned[OPTIMIZER_FILE]["reason"]
    assert reason == "store.keep_optimizer_state=2: older than the newest 2 policies of policy/p4"
    assert optimizer_state_gone(store, "p1").pruned["reason"] == reason
    assert optimizer_state_gone(store, "base") is None and optimizer_state_gone(store, "p2") is None
    assert prune_optimizer_states(store, "p4", keep=2) == []  # nothing new
    assert prune_optimizer_states(store, "q3", keep=1) == []  # its lineage: q3, p2 (none), p1 (pruned): stop

    # a pass killed after p3's manifest said pruned: the next pass deletes the file it left
    store.prune(POLICY, "p3", [OPTIMIZER_FILE], "keep 1")
    left = store.path(POLICY, "p3") / OPTIMIZER_FILE
    left.write_bytes(b"adam" * 20)
    assert prune_optimizer_states(store, "p4", keep=1) == [] and not left.exists()
    assert pruned(store) == {"p0", "p1", "p3"}  # the branch q3 keeps its state


@pytest.mark.slow  # processes killed midway
def test_a_retention_pass_killed_midway_is_finished_by_the_next(tmp_path):
    """A pass that dies at its first deletion has recorded one policy as pruned; the next pass
    walks back to that policy, stops there, and leaves no state behind: passes prune oldest
    first, so the policies before the one where the walk stops are pruned already."""
    store = Store(tmp_path)
    write_policy(store, "base", optimizer=False)
    previous = "base"
    for k in range(4):
        write_policy(store, f"p{k}", trained_from=previous)
        previous = f"p{k}"
    script = (
        "import os, pathlib\n"
        "from pipeline.store.retention import prune_optimizer_states\n"
        "from pipeline.store.versions import Store\n"
        "pathlib.Path.unlink = lambda self, missing_ok=False: os.kill(os.getpid(), 9)\n"
        f"prune_optimizer_states(Store({str(tmp_path)!r}), 'p3', keep=1)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], env=os.environ.copy()).returncode == -9
    assert pruned(store) == {"p0"}
    assert prune_optimizer_states(store, "p3", keep=1) == ["p1", "p2"]
    assert pruned(store) == {"p0", "p1", "p2"}
    assert [p.parent.name for p in (tmp_path / POLICY).glob(f"*/{OPTIMIZER_FILE}")] == ["p3"]


# ---------------------------------------------------------------------------------------
# Real flow runs: tiny iterations on the embedded model
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keeping_one(tmp_path_factory, prefect_server):
    """Two iterations keeping one AdamW state: the policy of iteration 0 is pruned after iteration 1."""
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=2,
        task={"rollouts": 4, "group_size": 2, "max_turns": 2},
        generation={"max_new_tokens": 32},
        ppo={"minibatch_rollouts": 4},
        store={"runs_dir": tmp_path_factory.mktemp("runs"), "keep_optimizer_state": 1},
    )
    return config, rl_training(config), Store(config.store.runs_dir)


@pytest.mark.slow  # keeping_one: a run of three iterations
def test_a_run_keeping_one_state_prunes_the_older_policy_and_resumes(keeping_one, tmp_path):
    from pipeline.orchestration.flows import rl_training
    from pipeline.store.diff import compare_runs

    config, (first, second), store = keeping_one
    assert pruned(store) == {first["next_policy"]}  # not the starting model, which never had one
    assert all(store.verify(m.stage, m.version) == [] for m in store.versions())
    updates = [store.manifest("ppo-update", r["versions"]["ppo-update"]) for r in (first, second)]
    # the starting model starts a fresh AdamW without any flag; iteration 1 continued iteration 0's
    assert updates[0].extra("optimizer_state_restored") == 0 and updates[1].extra("optimizer_state_restored") > 0
    assert all(update.settings["fresh_optimizer"] is False for update in updates)

    # run on: the stored iterations are reused (their pruned policy is not trained again), the third
    # continues the newest state, and then the second policy loses its state
    *again, third = rl_training(config.with_overrides({"iterations": 3}))
    assert again == [first, second]
    assert store.manifest("ppo-update", third["versions"]["ppo-update"]).extra("optimizer_state_restored") > 0
    assert pruned(store) == {first["next_policy"], second["next_policy"]}

    # mtrl diff compares what both runs kept: a copy that pruned the newest state too holds the same data
    copy = tmp_path / "copy"
    shutil.copytree(store.root, copy)
    Store(copy).prune(POLICY, third["next_policy"], [OPTIMIZER_FILE], "the copy keeps less")
    lines, different = compare_runs(store.root, copy)
    assert different == 0
    (newest,) = [line for line in lines if line.startswith("same  ('policy', 2, 'ppo-update')")]
    assert newest.endswith(f"in ['model.safetensors'], pruned, not compared: ['{OPTIMIZER_FILE}']")


@pytest.mark.slow  # keeping_one
def test_continuing_a_pruned_state_fails_clearly_and_the_flag_starts_a_fresh_adamw(keeping_one):
    from pipeline.orchestration.flows import rerun_stage

    config, (first, second), store = keeping_one
    source = f"compute-advantages/{second['versions']['compute-advantages']}"  # trained from first's policy
    other = config.with_overrides({"ppo.learning_rate": 5e-5})
    with pytest.raises(PrunedStateError) as refused:
        rerun_stage(other, "ppo-update", source)
    message = str(refused.value)
    assert f"AdamW state of policy/{first['next_policy']} (iteration 0)" in message
    assert "store.keep_optimizer_state=1" in message and "store.fresh_optimizer_if_pruned=true" in message

    allowed = {"store.fresh_optimizer_if_pruned": True}
    # where the update is stored already, the flag takes no effect: the same version, nothing trained
    assert rerun_stage(config.with_overrides(allowed), "ppo-update", source) == second["versions"]["ppo-update"]
    fresh = store.manifest("ppo-update", rerun_stage(other.with_overrides(allowed), "ppo-update", source))
    assert fresh.extra("optimizer_state_restored") == 0 and fresh.settings["fresh_optimizer"] is True
    assert store.exists(POLICY, fresh.policy) and store.verify(POLICY, fresh.policy) == []
