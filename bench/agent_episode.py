"""Does an agent's model call cost the same at call 50 as at call 1? One rollout of 50 calls.

    python bench/agent_episode.py [--calls 50] [--max-tokens 32] [--repeats 5] [--before HEAD]
                                  [--templates own,as-written] [--out bench/results/agent_episode_cpu.json]

An agent plays guess-number on the embedded model through mtrl's endpoint (real HTTP on 127.0.0.1,
one kept-alive httpx connection), in this process: one rollout that makes `--calls` calls with
short completions (`max_tokens`) and tool results between them, so that its history only grows:
the game's answers to its guesses (the game goes on past a correct guess with a new number), an
error for a malformed call, a reminder for a reply without one.

Each call is timed on the agent's side (its round trip) and inside the engine (from the moment the
engine takes the request to the moment it gives the completion back: the engine's `serve`
callbacks, wrapped in this process); record.next_call (rendering, tokenizing, matching) is timed
where the scheduler calls it:

    outside = round trip - engine

is what a call costs besides the model: HTTP, JSON, validating, rendering and tokenizing the
request, matching its assistant messages to the sampled calls, the reply. Each episode runs
`--repeats` times after a 3-call warm-up (the same seeds: the same tokens); a call's numbers are
the medians over the repeats. The floor: outside at calls 46-50 <= 1.2x calls 1-5 (their medians).

Two renderings, taking turns on the same episode: `after` (the working tree's record.py: a
call that adds a reply and tool results renders only those) and `before` (record.py of the commit
`--before`, loaded from git and put in the scheduler's hands by this script); the bench checks they
gave every call the same context. Two chat templates: `own`, the embedded model's (Qwen3's format),
and `as-written`, the same with Qwen3's reasoning rule taken out (an assistant turn is rendered as
written). Past its trained context length the tiny model writes junk. A reply with two </think>
blocks is rendered by Qwen3's format without its middle: its sampled tokens no longer stand for
it, and from then on every call of the rollout is rendered whole (`own` only). A reply whose text
an earlier reply had with other tokens makes the earlier message stand for the newer call (matched
by its text): that call is rendered whole, a new segment (both). The report also compares, in both
renderings, the calls that `after` rendered from what they added.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from provenance import machine

REPO = Path(__file__).resolve().parents[1]
KEY = "bench-key"
TASK = "guess-number"
RECORD = "stages/generate_rollouts/agents/record.py"
# The embedded template's Qwen3 reasoning rule, and what the `as-written` template has instead.
REASONING_SPLIT = """        {%- if message.reasoning_content is not string and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
        {%- endif -%}
"""
REASONING_RULE = """        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
"""


def template_as_written(own: str) -> str:
    """The embedded model's template with Qwen3's reasoning rule taken out."""
    if REASONING_SPLIT not in own or REASONING_RULE not in own:
        sys.exit("the embedded template changed: update REASONING_SPLIT and REASONING_RULE")
    return own.replace(REASONING_SPLIT, "").replace(REASONING_RULE, "        {{- content -}}\n")


def rendering_of(commit: str) -> Callable[..., Any]:
    """next_call of record.py as it was at `commit`: its source from git, run as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:{RECORD}"], capture_output=True, text=True, check=True
    ).stdout
    name = f"record_at_{commit}"
    path = Path(tempfile.mkdtemp(prefix="mtrl-bench-")) / f"{name}.py"
    path.write_text(source)  # imported as a file of its own, as Python imports any module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.next_call


class Clocks:
    """Per call (by its sampling seed, unique per rollout and call): when the engine took it and gave
    it back; the seconds of each next_call, and whether it rendered only what was added."""

    def __init__(self) -> None:
        self.taken: dict[int, float] = {}
        self.given: dict[int, float] = {}
        self.next_call_s: list[float] = []
        self.added: list[bool] = []  # per call of `after`: rendered from what it added

    def wrap_engine(self, engine: Any) -> None:
        """The engine's serve(take, give, sampling), with take and give noting the time per request."""
        serve, clocks = engine.serve, self
        seeds: dict[int, int] = {}  # id(tag) -> seed, while the engine holds the request

        def timed_serve(take, give, sampling):
            def timed_take(idle):
                taken = take(idle)
                now = time.perf_counter()
                for tag, request in taken or ():
                    seeds[id(tag)] = request.seed
                    clocks.taken[request.seed] = now
                return taken

            def timed_give(tag, outcome):
                clocks.given[seeds.pop(id(tag))] = time.perf_counter()
                give(tag, outcome)

            return serve(timed_take, timed_give, sampling)

        engine.serve = timed_serve

    def use(self, next_call: Callable[..., Any]) -> None:
        """The scheduler calls this next_call, timed."""
        from stages.generate_rollouts.agents import scheduler

        clocks = self

        def timed_next_call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return next_call(*args, **kwargs)
            finally:
                clocks.next_call_s.append(time.perf_counter() - started)

        scheduler.next_call = timed_next_call

    def watch_added(self) -> None:
        """Note whether each call of the working tree's rendering rendered only what it added."""
        from stages.generate_rollouts.agents import record

        render_added, clocks = record._render_added, self

        def watched(*args, **kwargs):
            made = render_added(*args, **kwargs)
            clocks.added.append(made is not None)
            return made

        record._render_added = watched


class Game:
    """guess-number that goes on: a correct guess starts a new round with a new hidden number; the
    answers are the environment's own texts."""

    def __init__(self, task: dict[str, Any]):
        from stages.environments import ENVIRONMENTS

        self.environment, self.task, self.state, self.rounds = ENVIRONMENTS[TASK], dict(task), {}, 0

    def answer(self, arguments: dict[str, Any]) -> str:
        number = arguments.get("number")
        if not isinstance(number, int):
            return "Error: the guess must be an integer"
        secret = self.task["secret"]
        result = "higher" if number < secret else "lower" if number > secret else "correct"
        step = self.environment.step(self.task, 0, "", [{"arguments": {"number": number}}], [result], self.state)
        if result == "correct":  # a new round: a new number, the whole range again
            self.rounds += 1
            self.task["secret"] = random.Random(f"{secret}/{self.rounds}").randint(1, 100)
            self.state = {}
            return "correct: I am thinking of a new number between 1 and 100."
        self.state = step.state
        return step.observation[0]["content"]


def episode(base_url: str, start: dict[str, Any], calls: int, max_tokens: int) -> list[float]:
    """One rollout's agent: `calls` calls, each reply answered with tool messages (its guesses' answers,
    an error for a malformed call, a reminder for a reply without one); returns the round trips."""
    import httpx

    from stages.hermes import parse_tool_calls

    url = f"{base_url}/rollouts/{start['rollout_id']}/v1/chat/completions"
    game, messages, round_trips = Game(json.loads(start["task_payload"])), list(start["messages"]), []
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as http:
        for _ in range(calls):
            body = {"model": "policy", "messages": messages, "tools": start["tools"], "max_tokens": max_tokens}
            started = time.perf_counter()
            answer = http.post(url, json=body)
            round_trips.append(time.perf_counter() - started)
            answer.raise_for_status()
            message = answer.json()["choices"][0]["message"]
            messages.append({key: value for key, value in message.items() if value is not None})
            for call in message.get("tool_calls") or []:
                try:
                    arguments = json.loads(call["function"]["arguments"])
                except ValueError:
                    arguments = {}
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": game.answer(arguments)})
            if not message.get("tool_calls"):  # a malformed block comes back as text
                found = parse_tool_calls(message.get("content") or "")
                results = [f"Error: {call.error}" for call in found] or ["Use the guess tool."]
                messages += [{"role": "tool", "tool_call_id": "call_0", "content": result} for result in results]
    return round_trips


@contextlib.contextmanager
def served(engine: Any, tokenizer: Any, settings: Any, start: dict[str, Any], calls: int) -> Iterator[Any]:
    from stages.generate_rollouts import sampling_seed
    from stages.generate_rollouts.agents.endpoint import Endpoint
    from stages.generate_rollouts.agents.record import RolloutRecord

    records = {start["rollout_id"]: RolloutRecord(start, calls)}
    endpoint = Endpoint(
        engine,
        tokenizer,
        records,
        sampling=settings.engine.sampling(),
        max_new_tokens=settings.max_new_tokens,
        max_context_tokens=settings.engine.max_context_tokens,
        enable_thinking=settings.enable_thinking,
        seed_of=lambda rollout_id, call: sampling_seed(settings.engine.seed, 0, rollout_id, call),
        model="policy",
        api_key=KEY,
    )
    with endpoint:
        yield endpoint, records[start["rollout_id"]]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ends(calls: list[dict[str, Any]], field: str) -> dict[str, float]:
    """The medians of a field over the first five and the last five calls."""
    if len(calls) < 5:
        return {}
    head, tail = median([c[field] for c in calls[:5]]), median([c[field] for c in calls[-5:]])
    return {
        "first_five_ms": round(head, 3),
        "last_five_ms": round(tail, 3),
        "last_over_first": round(tail / head, 3),
    }


class Bench:
    def __init__(self, args: argparse.Namespace):
        from pipeline.models.base_model import EMBEDDED_POLICY
        from pipeline.orchestration.stage_runs import settings_of
        from schemas.config import RunConfig
        from stages.generate_rollouts import rollout_starts
        from stages.generate_rollouts.agents import record
        from stages.generate_rollouts.engine import open_engine
        from stages.policy.loading import load_tokenizer

        self.args = args
        self.settings = settings_of("generate-rollouts", RunConfig(task={"name": TASK, "rollouts": 1, "group_size": 1}))
        own = load_tokenizer(str(EMBEDDED_POLICY))
        self.tokenizers = {"own": own, "as-written": load_tokenizer(str(EMBEDDED_POLICY))}
        self.tokenizers["as-written"].chat_template = template_as_written(own.chat_template)
        self.engine = open_engine(EMBEDDED_POLICY, own, self.settings.engine)
        self.start = rollout_starts(self.settings, 0)[0]
        self.clocks = Clocks()
        self.clocks.wrap_engine(self.engine)
        self.clocks.watch_added()
        self.renderings = {"after": record.next_call}
        if args.before:
            self.renderings["before"] = rendering_of(args.before)

    def episode(self, template: str, rendering: str, calls: int) -> list[dict[str, Any]]:
        """One episode with this template and rendering: each call's numbers."""
        clocks = self.clocks
        clocks.use(self.renderings[rendering])
        first_render, first_added = len(clocks.next_call_s), len(clocks.added)
        with served(self.engine, self.tokenizers[template], self.settings, self.start, calls) as (endpoint, record):
            round_trips = episode(endpoint.base_url, self.start, calls, self.args.max_tokens)
        added = clocks.added[first_added:]
        return [
            {
                "stream": call.stream,
                "new_segment": call.new_segment,
                "added": added[index - 1] if rendering == "after" and index else None,
                "round_trip_s": round_trips[index],
                "engine_s": clocks.given[call.seed] - clocks.taken[call.seed],
                "next_call_s": clocks.next_call_s[first_render + index],
            }
            for index, call in enumerate(record.calls)
        ]

    def episodes(self, template: str) -> dict[str, list[list[dict[str, Any]]]]:
        """Per rendering, its repeats of the episode, the renderings taking turns (the machine's load
        weighs on both alike), after a warm-up of each."""
        for rendering in self.renderings:
            self.episode(template, rendering, 3)
        runs: dict[str, list[list[dict[str, Any]]]] = {rendering: [] for rendering in self.renderings}
        for _ in range(self.args.repeats):
            for rendering in runs:
                runs[rendering].append(self.episode(template, rendering, self.args.calls))
        return runs

    def report(self, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Per call, the medians over the repeats; then calls 1-5 against the last five."""
        if any([c["stream"] for c in run] != [c["stream"] for c in runs[0]] for run in runs):
            sys.exit("the repeats gave different contexts: the episode is not deterministic")
        calls = []
        for index, call in enumerate(runs[0]):
            each = [run[index] for run in runs]
            calls.append(
                {
                    "call": index + 1,
                    "stream_tokens": len(call["stream"]),
                    "new_segment": call["new_segment"],
                    **({} if call["added"] is None else {"rendered": "added" if call["added"] else "whole"}),
                    "round_trip_ms": round(1000 * median([c["round_trip_s"] for c in each]), 3),
                    "engine_ms": round(1000 * median([c["engine_s"] for c in each]), 3),
                    "outside_ms": round(1000 * median([c["round_trip_s"] - c["engine_s"] for c in each]), 3),
                    "next_call_ms": round(1000 * median([c["next_call_s"] for c in each]), 3),
                }
            )
        return {
            "new_segments": sum(call["new_segment"] for call in calls),
            "rendered_whole_after_call_1": sum(call.get("rendered") == "whole" for call in calls),
            "outside": ends(calls, "outside_ms"),
            "next_call": ends(calls, "next_call_ms"),
            "calls": calls,
        }

    def run(self) -> dict[str, Any]:
        reports = {}
        for template in self.args.templates.split(","):
            runs = self.episodes(template)
            for rendering, repeats in runs.items():
                reports[f"{template}/{rendering}"] = self.report(repeats)
                print(f"[{template}/{rendering}] outside {reports[f'{template}/{rendering}']['outside']}", flush=True)
            contexts = [[call["stream"] for call in repeats[0]] for repeats in runs.values()]
            if any(context != contexts[0] for context in contexts):
                sys.exit(f"[{template}] the renderings gave different contexts")
            # the calls `after` rendered from what they added, compared in both renderings
            after = reports[f"{template}/after"]["calls"]
            added = {call["call"] for call in after if call.get("rendered") == "added"}
            for rendering in self.renderings:
                report = reports[f"{template}/{rendering}"]
                calls = [call for call in report["calls"] if call["call"] in added]
                report["calls_rendered_from_what_they_added"] = {
                    "calls": [call["call"] for call in calls],
                    "outside": ends(calls, "outside_ms"),
                    "next_call": ends(calls, "next_call_ms"),
                }
        self.engine.close()
        return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32, help="of each call")
    parser.add_argument("--repeats", type=int, default=5, help="episodes measured per rendering (after a warm-up)")
    parser.add_argument("--before", default="HEAD", help="the commit whose record.py is `before` ('' for none)")
    parser.add_argument("--templates", default="own,as-written")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_episode_cpu.json")
    args = parser.parse_args()
    os.chdir(REPO)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    report: dict[str, Any] = {
        "question": "the time an agent's call spends outside the engine, at call 50 against call 1",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    bench = Bench(args)
    report["settings"] = {
        "task": TASK,
        "calls": args.calls,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "before": args.before
        and subprocess.run(["git", "rev-parse", args.before], capture_output=True, text=True).stdout.strip(),
        "engine": bench.settings.engine.name,
        "enable_thinking": bench.settings.enable_thinking,
        "max_context_tokens": bench.settings.engine.max_context_tokens,
    }
    report["runs"] = bench.run()
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, run in report["runs"].items():
        print(f"\n{name}: outside {run['outside']}, next_call {run['next_call']}")
        print(f"calls rendered from what they added: {run['calls_rendered_from_what_they_added']}")
        print("call  segment  rendered  stream  outside_ms  next_call_ms")
        for call in run["calls"]:
            print(
                f"{call['call']:4}  {'new' if call['new_segment'] else '   ':7}  {call.get('rendered', ''):8}"
                f"  {call['stream_tokens']:6}  {call['outside_ms']:10.2f}  {call['next_call_ms']:12.2f}"
            )


if __name__ == "__main__":
    main()
