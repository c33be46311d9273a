"""OpenEnv environments as tasks: `--task openenv/LABEL` (docs/environments.md), with
task.options["openenv/LABEL"] = {"environment": "package.module.Class"} (made in this process,
with the keyword arguments `kwargs`) or {"url": "http://host:port"} (a server, over its WebSocket;
`max_sessions` at once, 1 by default, as OpenEnv's server allows).

Onto the Environment contract:
- reset(seed=S) gives the first user message: the observation's text (its one string field, the
  field `observation_field`, or its fields as JSON). S is drawn from the iteration's task seed.
- A reply without tool calls is an action: its one required string field (or `action_field`)
  holds the reply's visible text, and the observation's text is the next user message. An
  environment without such a field (a pure MCP environment) takes that reply as its final answer.
- An MCPEnvironment's tools (ListToolsAction) are the task's tools, shown to the model as Hermes
  tools; each call is a CallToolAction inside the episode, its result (or error) the tool message.
- An observation's reward is the turn's reward, or the outcome reward when it is done.

No episode is kept between turns: each step makes a new one (a new instance, or a new session of
the server), resets it with the task's seed, replays the actions the rollout's state holds, each
observation checked against the digest stored when it was first seen, and then acts. So a turn
re-runs to the same bytes in any process (`mtrl stage execute-tools`), and an environment that
does not repeat itself (randomness outside its seed, a server that changed) fails the rollout,
naming the action, instead of diverging.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import random
import threading
import time
import typing
import urllib.request
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from openenv.core.env_server import Action, deserialize_action, serialize_observation
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed

from runtime.hashing import source_version
from stages.environments import SYSTEM_PROMPT, Environment, EnvStep, ReplayError, final_answer

SEEDS = 2**31
OPTIONS = ("environment", "kwargs", "url", "max_sessions", "action_field", "observation_field")
CAPACITY_WAIT_S = 30.0  # how long a new session waits for a server to let go of a closed one
LIST_TOOLS = {"type": "list_tools"}
Outcome = tuple[dict[str, Any], float | None, bool]  # an observation's fields, its reward, done


def digest(outcome: Outcome) -> str:
    return hashlib.sha256(json.dumps(outcome, sort_keys=True, default=str).encode()).hexdigest()[:16]


class LocalEpisode:
    """An episode of an environment class, in this process."""

    def __init__(self, environment_class: type, kwargs: dict[str, Any]) -> None:
        self.environment = environment_class(**kwargs)
        hints = typing.get_type_hints(environment_class.step)
        self.action_class = hints.get("action", Action)

    @staticmethod
    def _outcome(observation: Any) -> Outcome:
        payload = serialize_observation(observation)  # what a server sends: one form for both
        return json.loads(json.dumps(payload["observation"], default=str)), payload["reward"], payload["done"]

    def reset(self, seed: int) -> Outcome:
        return self._outcome(self.environment.reset(seed=seed))

    def act(self, payload: dict[str, Any]) -> Outcome:
        return self._outcome(self.environment.step(deserialize_action(payload, self.action_class)))

    def close(self) -> None:
        self.environment.close()


class RemoteEpisode:
    """An episode on an environment server: one WebSocket session, holding one of the process's
    `max_sessions` places for that server (OpenEnv serves one session at a time unless its server
    is told otherwise)."""

    def __init__(self, url: str, max_sessions: int) -> None:
        self.place = places(url, max_sessions)
        self.place.acquire()
        try:
            self.client = self._connect(url)
        except BaseException:
            self.place.release()
            raise

    @staticmethod
    def _connect(url: str) -> Any:
        """A session; a server that still counts a session that has just closed is asked again."""
        deadline = time.monotonic() + CAPACITY_WAIT_S
        while True:
            client = GenericEnvClient(base_url=url).sync()
            try:
                client.connect()
                client.state()  # the first message: a server at capacity refuses it
                return client
            except Exception as exc:
                client.close()
                full = "CAPACITY_REACHED" in str(exc) or isinstance(exc, ConnectionClosed)
                if not full or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @staticmethod
    def _outcome(result: Any) -> Outcome:
        return result.observation, result.reward, result.done

    def reset(self, seed: int) -> Outcome:
        return self._outcome(self.client.reset(seed=seed))

    def act(self, payload: dict[str, Any]) -> Outcome:
        return self._outcome(self.client.step(payload))

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.place.release()


@functools.cache
def places(url: str, max_sessions: int) -> threading.BoundedSemaphore:
    """How many sessions this process opens on a server at once."""
    return threading.BoundedSemaphore(max_sessions)


def import_class(path: str) -> type:
    """A class by its dotted path, package.module.Class."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import the OpenEnv environment class '{path}': {exc}") from None


def observation_text(fields: dict[str, Any], field: str | None) -> str:
    """What the model reads of an observation: `field`, its one string field, or its fields as JSON."""
    if field is not None:
        return str(fields[field])
    strings = [value for value in fields.values() if isinstance(value, str)]
    if len(fields) == 1 and strings:
        return strings[0]
    return json.dumps(fields, sort_keys=True, default=str)


def tool_result(fields: dict[str, Any]) -> tuple[str, str | None]:
    """A CallToolObservation's result as (text for the model, None or the failure kind)."""
    if fields.get("error"):
        return f"Error: {fields['error'].get('message', fields['error'])}", "raised"
    result = fields.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        text = "\n".join(str(item.get("text", f"[{item.get('type')} content]")) for item in result["content"])
        return (f"Error: {text}", "raised") if result.get("is_error") else (text, None)
    return (result if isinstance(result, str) else json.dumps(result, sort_keys=True, default=str)), None


class OpenEnvEnv(Environment):
    """One OpenEnv environment, in process or at a URL."""

    max_turns = 50  # the environment's own `done` usually ends an episode first

    def __init__(self, label: str, options: dict[str, Any]) -> None:
        self.name, self.options = f"openenv/{label}", dict(options)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"{self.name}: unknown option(s) {unknown}; valid: {', '.join(OPTIONS)}")
        if ("environment" in options) == ("url" in options):
            raise ValueError(f"{self.name}: give exactly one of 'environment' (a class path) and 'url' (a server)")
        self.environment_class = import_class(options["environment"]) if "environment" in options else None
        with self.episode() as episode:
            action_schema = self._action_schema(episode)
            tools = self._tools(episode)
        self.identity_fields = {"action_schema": action_schema, "tools": tools}
        self.action_field = options.get("action_field") or self._text_field(action_schema)
        self.own_tool_schemas = [
            {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                              "parameters": t.get("input_schema") or {"type": "object"}}}
            for t in tools
        ]  # fmt: skip
        self.tools = tuple(tool["name"] for tool in tools)
        self.runs_tool_calls = bool(tools)
        if self.action_field is None and not tools:
            raise ValueError(
                f"{self.name}: its action has no single text field to hold a reply and it serves no tools: set "
                f"action_field (action schema: {json.dumps(action_schema.get('properties', {}))[:300]})"
            )

    @contextlib.contextmanager
    def episode(self) -> Iterator[Any]:
        episode = (
            LocalEpisode(self.environment_class, self.options.get("kwargs", {}))
            if self.environment_class is not None
            else RemoteEpisode(self.options["url"], int(self.options.get("max_sessions", 1)))
        )
        try:
            yield episode
        finally:
            episode.close()

    def _action_schema(self, episode: Any) -> dict[str, Any]:
        if isinstance(episode, LocalEpisode):
            return episode.action_class.model_json_schema()
        with urllib.request.urlopen(f"{self.options['url'].rstrip('/')}/schema", timeout=30) as answer:
            return json.loads(answer.read())["action"]

    @staticmethod
    def _tools(episode: Any) -> list[dict[str, Any]]:
        """An MCP environment's tools (name, description, input_schema); [] for any other."""
        try:
            fields, _, _ = episode.act(LIST_TOOLS)
        except Exception:  # an action class that is not MCP's refuses the action
            return []
        return [dict(tool) for tool in fields.get("tools", [])]

    @staticmethod
    def _text_field(schema: dict[str, Any]) -> str | None:
        """The action's one required string field (not an MCP action's tool_name)."""
        properties = schema.get("properties", {})
        if "tool_name" in properties:
            return None
        texts = [name for name in schema.get("required", []) if properties.get(name, {}).get("type") == "string"]
        return texts[0] if len(texts) == 1 else None

    def identity(self) -> dict[str, Any]:
        code = {}
        if self.environment_class is not None:
            code = {"environment_code": source_version(inspect.getsourcefile(self.environment_class))}
        package = {"package": f"openenv-core=={metadata.version('openenv-core')}", "options": self.options}
        return package | self.identity_fields | code

    def sample_task(self, rng: random.Random) -> dict[str, Any]:
        seed = rng.randrange(SEEDS)
        with self.episode() as episode:
            fields, _, _ = episode.reset(seed)
        return {"seed": seed, "question": observation_text(fields, self.options.get("observation_field"))}

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    def step(self, task, turn, assistant_text, tool_calls, tool_results, state) -> EnvStep:
        if tool_calls and not self.runs_tool_calls:  # tools mtrl ran (task.tools): their results are the observation
            return super().step(task, turn, assistant_text, tool_calls, tool_results, state)
        if tool_calls:
            new = [{"type": "call_tool", "tool_name": c["name"], "arguments": c["arguments"]} for c in tool_calls]
        elif self.action_field is not None:
            new = [{self.action_field: final_answer(assistant_text)}]
        else:  # a pure MCP environment: a reply without tool calls is the final answer
            return EnvStep(done=True, state={**state, "reward": 0.0}, tool_results=[])
        played, seen = list(state.get("actions", [])), list(state.get("observations", []))
        field = self.options.get("observation_field")
        messages, results, turn_reward, final_reward, done = [], [], 0.0, 0.0, False
        with self.episode() as episode:
            fields, _, _ = episode.reset(task["seed"])
            if observation_text(fields, field) != task["question"]:
                raise ReplayError(f"{self.name} reset with seed {task['seed']} did not show the stored first message")
            for index, (action, expected) in enumerate(zip(played, seen)):
                if digest(episode.act(action)) != expected:
                    raise ReplayError(
                        f"{self.name} replayed from seed {task['seed']} did not answer action {index} as it did the "
                        "first time: the environment is not determined by its seed and actions"
                    )
            for action in new:
                if done:  # the episode ended at an earlier call of this turn
                    results.append(("Error: the episode ended before this call", "raised"))
                    continue
                outcome = episode.act(action)
                played.append(action)
                seen.append(digest(outcome))
                fields, reward, done = outcome
                if done:
                    final_reward = float(reward or 0.0)
                else:
                    turn_reward += float(reward or 0.0)
                if tool_calls:
                    results.append(tool_result(fields))
                    messages.append({"role": "tool", "content": results[-1][0]})
                else:
                    messages.append({"role": "user", "content": observation_text(fields, field)})
        state = {"actions": played, "observations": seen}
        ran = results if self.runs_tool_calls else None
        if done:
            return EnvStep(done=True, reward=turn_reward, state={**state, "reward": final_reward}, tool_results=ran)
        return EnvStep(observation=messages, reward=turn_reward, state=state, tool_results=ran)

    def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
        return json.loads(final_turn["next_env_state"])["reward"]
