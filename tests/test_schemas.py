"""Data contracts: dtypes survive save/load bit-exactly; the config validates every field."""

from __future__ import annotations

import math

import datasets
import numpy as np
import pytest
from pydantic import ValidationError

from schemas.config import RunConfig
from schemas.features import COMPUTE_ADVANTAGES, dataset_from_rows


def test_token_ids_and_logprobs_survive_save_and_load_bit_exactly(tmp_path):
    rng = np.random.default_rng(0)
    logprobs = [
        rng.standard_normal(7).astype(np.float32) * -3,
        np.array([-0.0, -1e-8, -1e-45, -np.float32(np.pi), -88.72284], dtype=np.float32),  # incl. a denormal
    ]
    ids = [rng.integers(0, 2**31 - 1, 7, dtype=np.int64).astype(np.int32), np.array([0, 1, 2, 3, 2**31 - 1], np.int32)]
    rows = [
        {
            "rollout_id": i,
            "group_id": 0,
            "task": "calculator",
            "task_id": "t",
            "task_payload": "{}",
            "iteration": 0,
            "turn": 0,
            "policy_version": "p",
            "sampling_seed": 2**62 + i,
            "stream_offset": 0,
            "context_token_ids": [],
            "completion_token_ids": ids[i].tolist(),
            "completion_logprobs": logprobs[i].tolist(),
            "finish_reason": "stop",
            "thinking": "",
            "content": "",
            "tool_calls": [],
            "observation": "",
            "observation_token_ids": [],
            "turn_reward": 0.0,
            "terminated": True,
            "truncated": False,
            "stop_reason": "done",
            "failed": False,
            "failure": None,
            "reward": math.nan if i else 1.0,
            "advantages": [0.5] * len(ids[i]),
            "returns": [1.0] * len(ids[i]),
        }
        for i in range(2)
    ]
    dataset_from_rows(rows, COMPUTE_ADVANTAGES).save_to_disk(str(tmp_path / "d"))
    loaded = datasets.load_from_disk(str(tmp_path / "d"))
    assert loaded.features == COMPUTE_ADVANTAGES
    table = loaded.data.table
    for i in range(2):
        stored_ids = np.asarray(table.column("completion_token_ids")[i].values, dtype=np.int32)
        stored_lp = np.asarray(table.column("completion_logprobs")[i].values)
        assert stored_lp.dtype == np.float32 and stored_ids.dtype == np.int32
        assert stored_ids.tobytes() == ids[i].tobytes()
        assert stored_lp.tobytes() == logprobs[i].tobytes()
    assert loaded[0]["sampling_seed"] == 2**62 and math.isnan(loaded[1]["reward"])


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValidationError, match="learning_rate"):
        RunConfig().with_overrides({"ppo.learning_rate": -1})
    with pytest.raises(ValidationError, match="multiple of group_size"):
        RunConfig().with_overrides({"task.rollouts": 10, "task.group_size": 4})
    with pytest.raises(ValueError, match="unknown config field 'ppo.lr'"):
        RunConfig().with_overrides({"ppo.lr": 1e-3})
    with pytest.raises(ValidationError, match="temperature"):
        RunConfig(generation={"temperature": 0})


def test_config_loads_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\ntask:\n  rollouts: 16\n  group_size: 4\nppo:\n  epochs: 2\n")
    config = RunConfig.from_yaml(path).with_overrides({"advantage.estimator": "rloo"})
    assert (config.seed, config.task.rollouts, config.ppo.epochs, config.advantage.estimator) == (3, 16, 2, "rloo")
    (tmp_path / "bad.yaml").write_text("ppo:\n  nonsense: 1\n")
    with pytest.raises(ValidationError, match="nonsense"):
        RunConfig.from_yaml(tmp_path / "bad.yaml")
