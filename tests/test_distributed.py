"""ppo-update on two processes (ppo.world_size=2): real torchrun, real gloo, FSDP2 on the CPU.

The same compute-advantages version trained by one process and by two must give the same
next policy, metrics rows and AdamW state up to float rounding (the ranks sum gradients in
another order); the state must continue at either world size; a rank that dies must fail
the stage by name and leave nothing behind.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.distributed import TrainingProcessError
from pipeline.stage_table import POLICY
from pipeline.store import Store
from schemas.config import RunConfig
from stages.policy import OPTIMIZER_FILE, ValueHead, load_model

# Measured here (torch 2.13 CPU, 2 ranks): weights differ by at most 2.9e-6 after 2 epochs at lr 1e-4
# (a step moves a weight by about 1e-4), AdamW moments by 6e-9, metrics by 5e-6 (ratio_max).
WEIGHT_TOLERANCE = 1e-5
OPTIMIZER_TOLERANCE = 1e-6
METRIC_TOLERANCE = 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    """Two iterations on one process, GAE (a value head) with gradient accumulation (2 passes
    per mini-batch) and activation checkpointing: iteration 1 starts from a saved AdamW state."""
    from pipeline.flows import rl_training

    config = RunConfig(
        iterations=2,
        task={"rollouts": 8, "group_size": 4, "max_turns": 2},
        generation={"max_new_tokens": 48},
        advantage={"estimator": "gae"},
        ppo={"minibatch_rollouts": 4, "micro_batch_rollouts": 2, "epochs": 2, "gradient_checkpointing": True},
        store={"runs_dir": tmp_path_factory.mktemp("runs")},
    )
    return config, rl_training(config), Store(config.store.runs_dir)


def update(config: RunConfig, advantaged: str, **ppo) -> str:
    """ppo-update of a stored compute-advantages version with these ppo fields."""
    from pipeline.flows import rerun_stage

    changed = config.with_overrides({f"ppo.{name}": value for name, value in ppo.items()})
    return rerun_stage(changed, "ppo-update", f"compute-advantages/{advantaged}")


def max_difference(a: Path, b: Path, name: str) -> float:
    first, second = load_file(a / name), load_file(b / name)
    assert first.keys() == second.keys(), name
    return max((first[key].double() - second[key].double()).abs().max().item() for key in first)


def assert_same_update(store: Store, one: str, two: str) -> None:
    """The two ppo-update versions wrote equal policies, AdamW states and metrics rows."""
    policy_one = store.policy_dir(store.manifest("ppo-update", one).policy)
    policy_two = store.policy_dir(store.manifest("ppo-update", two).policy)
    assert one != two  # the world size is part of the version
    assert max_difference(policy_one, policy_two, "model.safetensors") < WEIGHT_TOLERANCE
    assert max_difference(policy_one, policy_two, OPTIMIZER_FILE) < OPTIMIZER_TOLERANCE
    if (policy_one / ValueHead.FILE).is_file():
        assert max_difference(policy_one, policy_two, ValueHead.FILE) < WEIGHT_TOLERANCE
    rows_one, rows_two = store.load("ppo-update", one).to_list(), store.load("ppo-update", two).to_list()
    assert len(rows_one) == len(rows_two) > 1
    for row_one, row_two in zip(rows_one, rows_two):
        assert row_one.keys() == row_two.keys()
        for name, value in row_one.items():
            if value is None or isinstance(value, int):
                assert row_two[name] == value, name
            else:
                assert row_two[name] == pytest.approx(value, rel=METRIC_TOLERANCE, abs=1e-6), name
    # it moved the weights at all: equal within the tolerance is not equal to the start
    start = store.policy_dir(store.manifest("ppo-update", one).parents[POLICY])
    assert max_difference(start, policy_two, "model.safetensors") > 10 * WEIGHT_TOLERANCE


def test_two_processes_continue_adamw_and_train_the_same_policy_as_one(two_iterations):
    config, results, store = two_iterations
    advantaged, on_one = results[1]["versions"]["compute-advantages"], results[1]["versions"]["ppo-update"]
    on_two = update(config, advantaged, world_size=2)
    assert_same_update(store, on_one, on_two)
    manifest = store.manifest("ppo-update", on_two)
    trainable = len(list(load_model(store.policy_dir(results[1]["policy"]), "float32", "cpu").parameters()))
    # the AdamW state that one process saved continued, sharded, on two (+2: the value head's)
    assert manifest.extra("optimizer_state_restored") == trainable + 2
    assert [rank["peak_rss_mb"] > 0 for rank in manifest.extra("memory")["ranks"]] == [True, True]


def test_the_state_saved_by_two_processes_continues_on_one(two_iterations):
    from stages.ppo_update import train_policy

    config, results, store = two_iterations
    advantaged = results[1]["versions"]["compute-advantages"]
    on_one, on_two = update(config, advantaged), update(config, advantaged, world_size=2)
    turns = store.load("compute-advantages", advantaged)
    continued = []
    for version in (on_one, on_two):
        trained = train_policy(
            turns,
            store.policy_dir(store.manifest("ppo-update", version).policy),
            config=config.ppo,
            train_critic=True,
            temperature=config.generation.temperature,
            seed=7,
            device="cpu",
        )
        assert trained.optimizer_state_restored == len(list(trained.model.parameters())) + 2
        continued.append(trained.model.state_dict())
    for name, tensor in continued[0].items():
        assert (tensor - continued[1][name]).abs().max().item() < WEIGHT_TOLERANCE, name


def test_packed_micro_batches_and_sequence_mean_on_two_processes(two_iterations):
    config, results, store = two_iterations
    advantaged = results[1]["versions"]["compute-advantages"]
    packed = {"max_tokens_per_micro_batch": 160, "loss_aggregation": "seq-mean-token-mean"}
    assert_same_update(store, update(config, advantaged, **packed), update(config, advantaged, world_size=2, **packed))


def test_a_rank_killed_mid_update_fails_the_stage_by_name_and_a_rerun_completes(two_iterations):
    config, results, store = two_iterations
    advantaged = results[0]["versions"]["compute-advantages"]
    long_update = {"world_size": 2, "epochs": 6, "minibatch_rollouts": 2}  # 24 optimiser steps
    policies_before = {m.version for m in store.versions(POLICY)}
    killed: list[int] = []

    def kill_rank_1_after_the_first_step() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            logs = {path: path.read_text() for path in store.root.glob("ppo-update/.tmp-*/logs/**/stdout.log")}
            pid = next(
                (m.group(1) for text in logs.values() for m in [re.search(r"rank 1 of 2: pid (\d+)", text)] if m), None
            )
            if pid and any("mtrl-progress" in text for text in logs.values()):
                import os
                import signal

                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            time.sleep(0.05)

    killer = threading.Thread(target=kill_rank_1_after_the_first_step)
    killer.start()
    with pytest.raises(TrainingProcessError, match=r"rank 1 of 2 died \(killed by SIGKILL\); no policy was written"):
        update(config, advantaged, **long_update)
    killer.join()
    assert killed, "rank 1 was never seen mid-update"
    assert {m.version for m in store.versions(POLICY)} == policies_before
    assert not list(store.root.glob("*/.tmp-*"))  # neither the policy's nor the job's temporary folder

    version = update(config, advantaged, **long_update)
    assert store.exists(POLICY, store.manifest("ppo-update", version).policy)
    assert len(store.load("ppo-update", version)) == 24


def test_lora_on_several_processes_is_refused_by_the_config():
    with pytest.raises(ValueError, match="LoRA updates run in one process"):
        RunConfig(ppo={"world_size": 2, "lora_rank": 4})
    assert torch.distributed.is_available()


def test_the_failure_names_the_rank_torchrun_reports_first_and_quotes_its_last_lines():
    from collections import deque

    from pipeline.distributed import failure_message

    report = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)", "  exitcode  : 1"]
    tails = {"torchrun": deque(report), "0": deque(["a line of rank 0"]), "1": deque(["Traceback", "ValueError: boom"])}
    message = failure_message(1, 2, tails)
    assert message.startswith("ppo-update failed: training process rank 1 of 2 died (exit code 1)")
    assert "ValueError: boom" in message and "a line of rank 0" not in message.split("torchrun:")[0]
