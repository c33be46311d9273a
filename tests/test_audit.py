"""The audit rejects each kind of planted corruption with a message naming it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.store.audit import audit
from pipeline.store.versions import Store, StoreError
from schemas.config import RunConfig
from stages.registry import Tasks

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig
    from stages.policy.loading import load_tokenizer

    config = RunConfig(
        iterations=1,
        task={"rollouts": 8, "group_size": 4, "max_turns": 3},
        generation={"max_new_tokens": 64},
        store={"runs_dir": tmp_path_factory.mktemp("audit")},
    )
    (result,) = rl_training(config)
    store = Store(config.store.runs_dir)
    turns = store.load("compute-advantages", result["versions"]["compute-advantages"])
    return store, turns, load_tokenizer(str(store.policy_dir(result["policy"]))), result


def check(run, turns):
    store, _, tokenizer, _ = run
    tasks = Tasks.resolve(RunConfig())  # the calculator task, as the run's
    return audit(
        turns,
        store,
        tokenizer,
        enable_thinking=True,
        environments=tasks.environments(),
        tools=tasks.tools(),
        rescore_fraction=1.0,
        rescore_tolerance=1e-3,
    )


def with_row(turns, index, **changes):
    rows = turns.to_list()
    rows[index] = {**rows[index], **changes}
    from datasets import Dataset

    return Dataset.from_list(rows, features=turns.features)


def two_turn_row(turns) -> int:
    return next(i for i, (t, o) in enumerate(zip(turns["turn"], turns["observation_token_ids"])) if t == 0 and o)


def test_clean_data_passes_and_ppo_update_recorded_the_audit(run):
    store, turns, _, result = run
    report = check(run, turns)
    assert report.ok, report.problems
    assert report.rescore_max_abs_diff < 1e-4
    manifest = store.manifest("ppo-update", result["versions"]["ppo-update"])
    assert manifest.extra("audit")["ok"] and set(manifest.extra("audit")["checks"]) >= {"stream", "lengths", "rescore"}


def test_shifted_logprobs_fail_the_rescoring(run):
    _, turns, _, _ = run
    i = two_turn_row(turns)
    shifted = np.roll(np.asarray(turns[i]["completion_logprobs"]), 1).tolist()
    report = check(run, with_row(turns, i, completion_logprobs=shifted))
    assert not report.ok and report.checks["rescore"] == 1
    assert "stored logprobs differ from the stored policy's" in report.problems[0]


def test_truncated_tokens_fail_lengths_and_stream(run):
    _, turns, _, _ = run
    i = two_turn_row(turns)
    report = check(run, with_row(turns, i, completion_token_ids=turns[i]["completion_token_ids"][:-1]))
    rollout = turns[i]["rollout_id"]
    assert any(
        p.startswith(f"lengths: rollout {rollout} turn 0:") and "completion_logprobs" in p for p in report.problems
    )
    assert any(p.startswith(f"stream: rollout {rollout} turn 1: stream_offset") for p in report.problems)


def test_observation_tokens_moved_into_the_loss_mask_are_caught(run):
    _, turns, _, _ = run
    i = two_turn_row(turns)
    row = turns[i]
    moved = row["observation_token_ids"][:3]
    report = check(
        run,
        with_row(
            turns,
            i,
            completion_token_ids=row["completion_token_ids"] + moved,
            completion_logprobs=row["completion_logprobs"] + [-0.1] * 3,
            advantages=row["advantages"] + [row["advantages"][0]] * 3,
            returns=row["returns"] + [row["returns"][0]] * 3,
            observation_token_ids=row["observation_token_ids"][3:],
        ),
    )
    assert not report.ok and report.checks["rescore"] == 1 and report.checks["stream"] >= 1


def test_nan_advantage_and_positive_logprob(run):
    _, turns, _, _ = run
    advantages = list(turns[0]["advantages"])
    advantages[1] = float("nan")
    report = check(run, with_row(turns, 0, advantages=advantages))
    assert any("advantages: rollout" in p and "advantage nan at completion token 1" in p for p in report.problems)
    logprobs = list(turns[0]["completion_logprobs"])
    logprobs[0] = 0.5
    report = check(run, with_row(turns, 0, completion_logprobs=logprobs))
    assert any("logprob 0.5 at completion token 0 (must be finite and <= 0)" in p for p in report.problems)


def test_missing_turns_and_missing_policy(run):
    _, turns, _, _ = run
    i = two_turn_row(turns)
    later = next(
        j for j, (r, t) in enumerate(zip(turns["rollout_id"], turns["turn"])) if r == turns[i]["rollout_id"] and t == 1
    )
    gap = turns.select([j for j in range(len(turns)) if j != i])
    assert any("contiguous: rollout" in p and "has turns [1" in p for p in check(run, gap).problems)
    unknown = with_row(turns, later, policy_version="0000000000000000")
    assert any(p == "policy: policy 0000000000000000 is not in the store" for p in check(run, unknown).problems)


def test_an_edited_dataset_file_is_refused(run):
    store, _, _, result = run
    version = result["versions"]["assign-rewards"]
    shard = next(store.path("assign-rewards", version).glob("*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupted or was edited: data-00000-of-00001.arrow differs from its digest"):
        store.load("assign-rewards", version)


def test_mtrl_audit_checks_a_later_turn_after_the_earlier_turns_of_its_rollouts(run, capsys):
    """A one-turn version holds only that turn: its stream offsets and logprobs are checked
    after the earlier turns of its rollouts, not as if they were rollouts of their own."""
    import json

    from pipeline.cli.main import main

    store, _, _, result = run
    later_tools = result["versions"]["execute-tools"][-1]
    assert store.manifest("execute-tools", later_tools).turn >= 1
    later_generation = store.manifest("execute-tools", later_tools).parents["generate-rollouts"]
    for reference in (f"execute-tools/{later_tools}", f"generate-rollouts/{later_generation}"):
        code = main(["audit", reference, "--runs-dir", str(store.root), "--rescore-fraction", "1"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["ok"], (reference, report["problems"])
        assert report["checks"]["stream"] == 0 and report["rescore_max_abs_diff"] < 1e-4


def test_bfloat16_generation_is_audited_with_the_tolerance_of_its_dtype(tmp_path):
    """The re-score is float32: bfloat16 rollouts differ from it by rounding (far above the
    float32 tolerance), and must not fail every iteration's audit for that."""
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=1,
        model={"dtype": "bfloat16"},
        task={"rollouts": 8, "group_size": 4, "max_turns": 2},
        generation={"max_new_tokens": 48},
        audit={"rescore_fraction": 1.0},
        store={"runs_dir": tmp_path},
    )
    (result,) = rl_training(config)
    report = Store(tmp_path).manifest("ppo-update", result["versions"]["ppo-update"]).extra("audit")
    assert report["ok"] and report["rescore_tolerance"] == 0.5
    assert 1e-3 < report["rescore_max_abs_diff"] < 0.5  # rounding, beyond what float32 allows
