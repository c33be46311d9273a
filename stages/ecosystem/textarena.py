"""textarena games as multi-turn tasks: `--task textarena/ENV_ID` (docs/environments.md).

The game is textarena's raw one (no wrappers), made with task.options["textarena/ENV_ID"] as its
arguments and played by one player. Its first messages (the rules) are the user message of the
first turn; each reply's visible text is the move, played as it is; the game's messages since
that move are the next user message; the game's reward when it ends is the outcome reward (its
full reward, 1, counts as solved: several games give partial credit to a loss).

A game is a live Python object, and none is kept between turns: each step makes the game again
from the task's seed, replays the moves the rollout's state holds, then plays the new move. So a
turn re-runs to the same bytes in any process (`mtrl stage execute-tools`). The replay checks
every observation against the digest stored when it was first seen: a game that does not repeat
itself (randomness outside its seed) fails the rollout, naming the turn, instead of diverging.

textarena games draw from Python's global `random`, seeded by reset: a game's reset, replay and
move hold one lock, with the global random state put back afterwards, so that concurrent
rollouts and the rest of the process do not disturb each other. What a game prints is dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import textarena
from textarena.envs.registration import ENV_REGISTRY

from stages.environments import Environment, EnvStep, ReplayError, final_answer

GAME_PROMPT = "You are playing a game. Each of your replies is your next move, in the format the rules ask for."
SEEDS = 2**31
_ALONE = threading.Lock()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """One game at a time in this process, with the global random state it found put back."""
    with _ALONE:
        saved = random.getstate()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            random.setstate(saved)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class TextArenaEnv(Environment):
    """One single-player textarena game with its arguments."""

    max_turns = 50  # the game's own limit usually ends it first

    def __init__(self, game: str, options: dict[str, Any]) -> None:
        if game not in ENV_REGISTRY:
            single = sorted(name for name in ENV_REGISTRY if "-v0" in name and not name.endswith("-raw"))
            raise ValueError(f"unknown textarena game '{game}'; registered: {', '.join(single)}")
        self.game, self.options = game, dict(options)
        self.name, self.tools = f"textarena/{game}", ()

    def identity(self) -> dict[str, Any]:
        return {"package": f"textarena=={metadata.version('textarena')}", "options": self.options}

    def _start(self, seed: int) -> tuple[Any, str]:
        """The raw game after reset(seed), and its first messages (call it alone())."""
        try:
            game = textarena.make(self.game, **self.options)
            while isinstance(game, textarena.Wrapper):  # the raw game: mtrl shows messages and passes moves itself
                game = game.env
            try:
                game.reset(num_players=1, seed=seed)
            except (AssertionError, ValueError) as exc:  # how textarena refuses a number of players
                raise ValueError(f"{self.name} is not a single-player game (mtrl plays those): {exc}") from None
        except LookupError as exc:  # nltk.data.find: a corpus that is not installed and could not be downloaded
            missing = next((line.strip() for line in str(exc).splitlines() if "not found" in line), str(exc))
            raise ValueError(
                f"{self.name} needs data that is not installed and could not be downloaded: {missing}"
            ) from None
        return game, self._messages(game)

    @staticmethod
    def _messages(game: Any) -> str:
        """The game's messages since the last call, less the echo of the player's own move."""
        player, messages = game.get_observation()
        return "\n".join(text.strip() for sender, text, _ in messages if sender != player).strip()

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        seed = rng.randrange(SEEDS)
        with alone():
            _, rules = self._start(seed)
        return {"seed": seed, "question": rules}

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": GAME_PROMPT}, {"role": "user", "content": task["question"]}]

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state) -> EnvStep:
        moves, seen = list(state.get("moves", [])), list(state.get("observations", []))
        move = final_answer(assistant_text)
        with alone():
            game, rules = self._start(task["seed"])
            if rules != task["question"]:
                raise ReplayError(f"{self.name} showed other rules from seed {task['seed']} than when it was sampled")
            for played, (earlier, expected) in enumerate(zip(moves, seen)):
                done, _ = game.step(earlier)
                if done or digest(self._messages(game)) != expected:
                    raise ReplayError(
                        f"{self.name} replayed from seed {task['seed']} did not answer move {played} as it did when "
                        "it was played: the game is not determined by its seed and moves"
                    )
            done, _ = game.step(move)
            observation = self._messages(game)
            rewards = game.close()[0] if done else None
        state = {"moves": [*moves, move], "observations": [*seen, digest(observation)]}
        if done:
            return EnvStep(done=True, state={**state, "reward": float((rewards or {}).get(0, 0.0))})
        return EnvStep(observation=[{"role": "user", "content": observation}], state=state)

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        return json.loads(final_turn["next_env_state"])["reward"]

    def solved(self, reward: float) -> bool:
        return reward >= 1.0
