"""A plugin environment whose episodes always last their turn limit: whatever the model says, it
is told to go on (tests/test_turn_state.py plays many turns of it)."""

import random

from stages.environments import ENVIRONMENTS, Environment, EnvStep


class LongTalkEnv(Environment):
    name = "long-talk"
    tools = ()
    max_turns = 50

    def sample_task(self, rng: random.Random) -> dict:
        return {"question": f"Say a number, then keep going: start at {rng.randint(1, 9)}."}

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state) -> EnvStep:
        return EnvStep(observation=[{"role": "user", "content": f"Go on ({turn + 1} said)."}])

    def reward(self, task: dict, final_turn: dict) -> float:
        return 0.0


ENVIRONMENTS[LongTalkEnv.name] = LongTalkEnv()
