"""A turn reads what it needs: turn t's generate-rollouts reads turn t - 1's execute-tools rows and
continues the token streams it kept when it generated turn t - 1, so a turn costs the same at turn
50 as at turn 1 (bench/long_episodes.py); the whole history is read only by a process that did not
generate the previous turn (a resume, `mtrl stage`), and gives the same bytes."""

from __future__ import annotations

import datasets
import pytest

from pipeline.models.base_model import import_base_policy
from pipeline.orchestration.stage_runs import run_stage
from pipeline.store.lineage import load_turns
from pipeline.store.versions import Store
from runtime.phases import PHASES
from schemas.config import RunConfig
from schemas.stage import POLICY
from schemas.token_stream import continue_streams, rollouts
from stages import generate_rollouts
from stages.environments import ENVIRONMENTS
from stages.generate_rollouts.engine import ENGINE

pytestmark = pytest.mark.slow  # its module fixture plays 6 turns in stage runs of their own (about 18 s)
TURNS = 6


def long_config(runs_dir) -> RunConfig:
    """Episodes that last TURNS turns (tests/plugin_long_talk.py), short turns."""
    return RunConfig(
        task={"name": "long-talk", "rollouts": 4, "group_size": 2, "max_turns": TURNS, "plugins": ["plugin_long_talk"]},
        generation={"max_new_tokens": 96},
        store={"runs_dir": runs_dir},
    )


def play(config: RunConfig, forget: bool) -> tuple[list[str], list[int]]:
    """An iteration's turns as the flow plays them; per turn, the datasets generate-rollouts read.
    `forget`: before every turn, the process forgets the streams and the engine's caches, as a
    process that did not generate the previous turn would."""
    policy = import_base_policy(Store(config.store.runs_dir), config)
    turns: list[str] = []
    reads: list[int] = []
    for turn in range(TURNS):
        if forget:
            generate_rollouts.STREAMS.clear()
            ENGINE.close()
        before = PHASES.calls["store_reads"]
        previous = {"execute-tools": turns[-1]} if turns else {}
        generated = run_stage(config, "generate-rollouts", {POLICY: policy, **previous}, {"iteration": 0, "turn": turn})
        reads.append(PHASES.calls["store_reads"] - before)
        executed = run_stage(config, "execute-tools", {"generate-rollouts": generated.version})
        turns.append(executed.version)
        if executed.active == 0:
            break
    ENGINE.close()
    return turns, reads


@pytest.fixture(scope="module")
def played(tmp_path_factory, prefect_server):
    generate_rollouts.STREAMS.clear()
    warm_config, cold_config = (long_config(tmp_path_factory.mktemp(name)) for name in ("warm", "cold"))
    yield (warm_config, *play(warm_config, forget=False)), (cold_config, *play(cold_config, forget=True))
    ENVIRONMENTS.pop("long-talk", None)  # the plugin's task: other tests list the registered ones


def test_a_turn_reads_only_the_previous_one_when_this_process_generated_it(played):
    (_, turns, reads), _ = played
    assert len(turns) == TURNS  # the rollouts go on to their turn limit
    assert reads == [0] + [1] * (TURNS - 1)  # the previous turn's execute-tools rows, whatever the turn


def test_a_process_that_did_not_generate_the_previous_turn_reads_the_history_once_and_makes_the_same_bytes(played):
    (warm_config, warm, _), (cold_config, cold, reads) = played
    # the previous turn, and once every earlier turn (the streams and the engine's replay of them)
    assert reads[1:] == [1 + turn for turn in range(1, TURNS)]
    warm_store, cold_store = Store(warm_config.store.runs_dir), Store(cold_config.store.runs_dir)
    for warm_version, cold_version in zip(warm, cold, strict=True):
        assert warm_version == cold_version  # the same inputs and settings: the same versions
        left, right = warm_store.load("execute-tools", warm_version), cold_store.load("execute-tools", cold_version)
        assert left.data.table == right.data.table


def test_streams_continued_turn_by_turn_are_the_streams_of_all_turns(played):
    (config, turns, _), _ = played
    store = Store(config.store.runs_dir)
    streams: dict[int, list[int]] = {}
    for version in turns:
        streams = {**streams, **continue_streams(streams, store.load("execute-tools", version))}
    history = load_turns(store, turns[-1])
    assert isinstance(history, datasets.Dataset)
    assert streams == {rollout.rollout_id: rollout.token_ids for rollout in rollouts(history)}
