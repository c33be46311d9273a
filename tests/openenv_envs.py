"""Two OpenEnv environments written as an OpenEnv user writes them, for the tests: a text game
(one text action per turn) and an MCPEnvironment whose tools the agent calls. Both are
determined by their reset seed, as OpenEnv asks. Serve one with

    python -m uvicorn tests.openenv_envs:guess_app --host 127.0.0.1 --port PORT    (from the checkout)
"""

from __future__ import annotations

import random
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    MCPEnvironment,
    Observation,
    State,
    create_fastapi_app,
)

RANGE = (1, 20)
MOVES = 6


class GuessAction(Action):
    guess: str  # the agent's reply: a number, in any words


class GuessObservation(Observation):
    feedback: str


class QuestionObservation(Observation):
    question: str


class GuessEnvironment(Environment):
    """Find a number between 1 and 20 in 6 moves; reward 1 when found."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(*RANGE)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=f"I am thinking of a number between {RANGE[0]} and {RANGE[1]}. Guess it.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = "".join(c for c in action.guess if c.isdigit())[:3]
        if not digits:
            feedback, solved = "That is not a number.", False
        else:
            number = int(digits)
            solved = number == self.secret
            feedback = "correct" if solved else "higher" if number < self.secret else "lower"
        done = solved or self._state.step_count >= MOVES
        return GuessObservation(feedback=feedback, done=done, reward=1.0 if solved else 0.0)

    @property
    def state(self) -> State:
        return self._state


guess_app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation)


class CalculatorToolEnvironment(MCPEnvironment):
    """A question about a sum; the agent has a calculate tool (MCP) and submits with a submit tool."""

    def __init__(self) -> None:
        tools = FastMCP("calculator-env")
        environment = self

        @tools.tool
        def calculate(expression: str) -> str:
            """Evaluate a sum of integers such as "12+30".

            Args:
                expression: The sum to evaluate.
            """
            return str(sum(int(term) for term in expression.replace(" ", "").split("+")))

        @tools.tool
        def submit(answer: int) -> str:
            """Submit the final answer.

            Args:
                answer: The number.
            """
            environment.submitted = answer
            return "submitted"

        super().__init__(tools)
        self._state = State(episode_id=None, step_count=0)
        self.terms: list[int] = []
        self.submitted: int | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self.terms, self.submitted = [rng.randint(2, 99), rng.randint(2, 99)], None
        self._state = State(episode_id=episode_id, step_count=0)
        return QuestionObservation(question=f"What is {self.terms[0]}+{self.terms[1]}? Submit it with the submit tool.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and self.submitted is not None:
            return CallToolObservation(
                tool_name="submit",
                result=observation.result,
                done=True,
                reward=1.0 if self.submitted == sum(self.terms) else 0.0,
            )
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state
