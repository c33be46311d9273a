"""textarena games as multi-turn tasks (stages/ecosystem/textarena.py), with the real package: a
game is played as textarena plays it, made again from its seed and moves at every step (so any
turn re-runs to the same bytes in another process), never diverging silently; a game that needs
a download is refused at run start."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import textarena

from pipeline.store.versions import Store
from schemas.config import RunConfig
from stages.environments import ReplayError
from stages.registry import Tasks, check_tasks

GUESS = "textarena/GuessTheNumber-v0"
# single-player games that go on after a reply that is not a move (an invalid move is warned about first)
GAMES = ("GuessTheNumber-v0", "ThreeCardMonte-v0", "Sudoku-v0", "LogicPuzzle-v0", "LightsOut-v0")


def play(env, task: dict, moves: list[str]) -> list:
    """Step the adapter through these moves; its EnvSteps."""
    steps, state = [], {}
    for turn, move in enumerate(moves):
        steps.append(env.step(task, turn, move, [], [], state))
        state = steps[-1].state
        if steps[-1].done:
            break
    return steps


def raw_game(seed: int):
    game = textarena.make("GuessTheNumber-v0")
    while isinstance(game, textarena.Wrapper):
        game = game.env
    game.reset(num_players=1, seed=seed)
    return game


def test_a_game_is_played_as_textarena_plays_it_and_won_by_bisection():
    env = Tasks.resolve(RunConfig(task={"name": GUESS})).environment(GUESS)
    task = env.sample_task(random.Random(0))
    assert "Guess The Number" in task["question"] and env.tools == ()
    low, high, state, turn, step = 1, 20, {}, 0, None
    direct = raw_game(task["seed"])
    direct.get_observation()
    while step is None or not step.done:
        guess = (low + high) // 2
        step = env.step(task, turn, f"My guess is [{guess}].", [], [], state)
        done, _ = direct.step(f"My guess is [{guess}].")
        _, messages = direct.get_observation()
        assert step.done == done
        if not step.done:
            (message,) = step.observation
            assert message == {"role": "user", "content": "\n".join(m.strip() for s, m, _ in messages if s != 0)}
            low, high = (guess + 1, high) if "higher" in message["content"] else (low, guess - 1)
        state, turn = step.state, turn + 1
    assert state["moves"][-1] == f"My guess is [{guess}]." and len(state["moves"]) == turn <= 5
    final_turn = {"next_env_state": json.dumps(state)}
    assert env.reward(task, final_turn) == 1.0 == direct.close()[0][0] and env.solved(1.0)
    # a loss earns the game's partial reward, which is no success
    lost = play(env, task, ["[1]", "[20]", "[2]", "[19]", "[3]", "[18]", "[4]", "[17]", "[5]", "[16]", "[6]"])
    assert lost[-1].done and 0 <= lost[-1].state["reward"] < 1 and not env.solved(lost[-1].state["reward"])


def test_a_game_that_does_not_repeat_its_answers_fails_instead_of_diverging():
    env = Tasks.resolve(RunConfig(task={"name": GUESS})).environment(GUESS)
    task = env.sample_task(random.Random(1))
    first, second = play(env, task, ["[10]", "[3]"])
    tampered = {**second.state, "observations": ["0" * 16, *second.state["observations"][1:]]}
    with pytest.raises(ReplayError, match="did not answer move 0 as it did"):
        env.step(task, 2, "[7]", [], [], tampered)
    with pytest.raises(ReplayError, match="other rules"):
        env.step({**task, "question": "other rules"}, 2, "[7]", [], [], second.state)


def test_concurrent_games_play_as_they_do_alone():
    """textarena draws from the global random: games stepped from 8 threads at once answer as
    they do one at a time, and the process's own random sequence is untouched."""
    env = Tasks.resolve(RunConfig(task={"name": GUESS})).environment(GUESS)
    tasks = [env.sample_task(random.Random(seed)) for seed in range(8)]
    moves = ["[10]", "[5]", "[15]", "[12]", "[7]"]
    alone = [[s.observation for s in play(env, task, moves)] for task in tasks]
    random.seed(123)
    expected = random.random()
    random.seed(123)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda task: [s.observation for s in play(env, task, moves)], tasks))
    assert together == alone and random.random() == expected


@pytest.mark.parametrize(
    ("game", "reason"),
    [
        ("Hangman-v0", "needs data that is not installed and could not be downloaded"),  # an NLTK corpus
        ("TicTacToe-v0", "is not a single-player game"),
        ("NoSuchGame-v0", "unknown textarena game 'NoSuchGame-v0'"),
    ],
)
def test_a_game_that_cannot_run_here_is_refused_at_run_start(game, reason):
    with pytest.raises(ValueError, match=reason):
        check_tasks(Tasks.resolve(RunConfig(task={"name": f"textarena/{game}"})), sandbox=True)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_one_iteration_of_five_games_and_a_turn_re_runs_to_the_same_bytes_elsewhere(tmp_path):
    from rerun import rerun_turn_elsewhere

    from pipeline.orchestration.flows import rl_training

    names = [f"textarena/{game}" for game in GAMES]
    config = RunConfig(
        iterations=1,
        task={"name": ",".join(names), "rollouts": 2 * len(GAMES), "group_size": 2, "max_turns": 3},
        generation={"max_new_tokens": 32},
        ppo={"minibatch_rollouts": 5},
        store={"runs_dir": tmp_path / "runs"},
    )
    (result,) = rl_training(config)
    store = Store(config.store.runs_dir)
    rewarded = store.load("assign-rewards", result["versions"]["assign-rewards"]).to_list()
    assert {row["task"] for row in rewarded} == set(names) and not any(row["failed"] for row in rewarded)
    for row in rewarded:
        if row["stop_reason"] == "done":  # the game ended it: its reward is the game's
            assert row["reward"] == json.loads(row["next_env_state"])["reward"]
    later = [row for row in rewarded if row["turn"] >= 1]
    assert later, "no game went on past its first move"
    assert all(json.loads(row["env_state"])["moves"] for row in later)  # the moves so far travel with the rollout
    # the second turn's execute-tools re-made in a new process: every game rebuilt from its seed and moves
    second = result["versions"]["execute-tools"][1]
    lines, different = rerun_turn_elsewhere(store.root, second, tmp_path)
    assert different == 0, "\n".join(lines)
