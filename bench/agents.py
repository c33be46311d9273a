"""Agent programs against the native loop: what the endpoint costs, what lock-step costs, and
whether the demo learns through the agent. One invocation, everything in one process:

    python bench/agents.py [--iterations 10] [--rollouts 64] [--guess-rollouts 64] [--slow-repeats 2]
                           [--no-native-default-workers] [--parts demo,slow,scale]
                           [--scale-rollouts 1024,4096] [--sync-rollouts 1024]
                           [--out bench/results/agents_cpu.json]

(i) The demo (the default config: calculator, 64 rollouts in groups of 8, 10 iterations, the hf
    engine), natively and through the openai-client agent (examples.agents.openai_loop:agent): the
    wall time of each run, its generation time (the sum of the generate-rollouts manifests'
    `wall_s`; an agent iteration runs all its agents inside its turn 0) and its engine's forward passes.
    Then the endpoint's own cost per model call, measured directly: the agent run's iteration-0
    requests (the bodies the openai client sent) are replayed one at a time against a fresh
    Endpoint on the same policy, first sampled (each request's render time: `record.next_call`),
    then sent again, identical: a retry is answered from the record without the model, so its
    round trip is the endpoint's cost alone: over httpx (one kept-alive connection) and through an
    openai.AsyncOpenAI per rollout (as agents call).
    The fixed costs of an agent iteration: the agents' process
    (`python stages/generate_rollouts/agents/child.py` with no rollout) and an openai.AsyncOpenAI per rollout:
    as written, on one shared httpx client, and as AgentRollout.client builds them.
(ii) Lock-step against running alone: slow-guess (bench/agent_bench_tasks.py: guess-number whose
    `guess` tool answers after a seeded latency of 0-2 s, a function of the game and the guess),
    one iteration natively with runner.max_workers = the rollouts (every rollout's tool of a turn
    at once; the default is 8) and one through an agent that plays the same game itself
    (bench.agent_bench_tasks:play), `--slow-repeats` pairs interleaved; then one native run with
    max_workers at its default. The tool workers are started before (their cold start, paid once
    per process, is reported apart). Reported: the walls of the rollout phase (the turns:
    generate-rollouts and execute-tools with their orchestration) and of the iteration, the ratios
    agent / native, and where the time goes: the engine's prefills and decode steps (rows per step),
    prefill tokens and seconds, decode steps and seconds; the tool latency's floor of each path
    (lock-step: the sum over turns of the turn's slowest guess; on their own: the longest
    rollout's sum); and whether the two paths stored the same tokens.
(iii) The learning curve through the agent: (i)'s runs' success rate per iteration, side by side.
(iv) Scale: the demo's work for one iteration at `--scale-rollouts` (1,024 and 4,096) rollouts, natively
    and through the openai-client agent, all agents at once; then `--sync-rollouts` (1,024) of a plain
    sync agent with its own httpx.Client (bench.agent_bench_tasks:calculator_over_httpx) at
    agent.concurrency 0 (a thread each). Reported per run: wall and rollout phase, success, failed
    rollouts by kind (timeouts, connection errors), the endpoint's own time per chat call (the
    handler's time less its call's wait for the engine: parsing, rendering, the reply; p50, p99) and
    this process's peak resident set (sampled every 50 ms).

The engine's work and render times are observed by wrapping HFEngine._forward, HFEngine._prefill, hf_serve.forward and
the endpoint's next_call in this process (clock reads and a list append per call). Threads: what a
user gets (runner.threads unset). The machine may be shared: the JSON records the load average
around each run and when the bench ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from provenance import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEMO_AGENT = "examples.agents.openai_loop:agent"
PLUGIN = "bench.agent_bench_tasks"
GUESS_AGENT = f"{PLUGIN}:play"
SYNC_AGENT = f"{PLUGIN}:calculator_over_httpx"
KEY = "bench-key"


def summary(values: list[float], scale: float = 1.0, digits: int = 3) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "mean": round(statistics.fmean(values) * scale, digits),
        "median": round(statistics.median(values) * scale, digits),
        "p90": round(sorted(values)[int(0.9 * (len(values) - 1))] * scale, digits),
        "p99": round(sorted(values)[int(0.99 * (len(values) - 1))] * scale, digits),
        "min": round(min(values) * scale, digits),
        "max": round(max(values) * scale, digits),
    }


def loads() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------------
# what happens inside the runs: engine calls, renders, the agents' process, the requests
# ---------------------------------------------------------------------------------------


class Probe:
    """Wraps HFEngine._forward and hf_serve.forward (each forward pass of the engine: its rows, the
    tokens it prefilled or none for a decode step, the seconds), the endpoint's next_call (render seconds),
    run_agents (the agents' process: until its first request) and Scheduler.submit (the request
    bodies of the first endpoint of a run, for the replay)."""

    def __init__(self) -> None:
        self.engine_calls: list[dict[str, Any]] = []
        self.renders: list[float] = []
        self.agent_iterations: list[dict[str, float]] = []
        self.captured: list[tuple[int, dict[str, Any]]] | None = None  # (rollout_id, body) of the first endpoint
        self.capture_endpoint: Any = None
        self.first_request: float | None = None
        self.own_call_s: list[float] = []  # per answered call: its time in the endpoint minus its wait for the engine

    def install(self) -> None:
        import stages.generate_rollouts as generate
        from stages.generate_rollouts import hf, hf_serve
        from stages.generate_rollouts.agents import scheduler, server

        probe = self
        forward, prefill, next_call = hf.HFEngine._forward, hf.HFEngine._prefill, scheduler.next_call
        serving_forward = hf_serve.forward
        run_agents, submit = generate.run_agents, scheduler.Scheduler.submit
        prefilling = [0]  # the tokens of the prefill under way (the engine runs one forward at a time)

        def timed_prefill(engine, new_tokens, shared):
            prefilling[0] = sum(len(tokens) for tokens in new_tokens)
            try:
                return prefill(engine, new_tokens, shared)
            finally:
                prefilling[0] = 0

        def timed(rows: int, prefill_tokens: int, started: float) -> None:
            probe.engine_calls.append(
                {"rows": rows, "prefill_tokens": prefill_tokens, "s": time.perf_counter() - started}
            )  # prefill_tokens 0: a decode step

        def timed_forward(engine, input_ids, new_mask):  # the native loop's turns (HFEngine.sample)
            started = time.perf_counter()
            logits = forward(engine, input_ids, new_mask)
            timed(input_ids.shape[0], prefilling[0], started)
            return logits

        def timed_serving_forward(model, cache, blocks, pad_token_id, prefill):  # the agents' calls (serve)
            started = time.perf_counter()
            logits = serving_forward(model, cache, blocks, pad_token_id, prefill)
            timed(len(blocks), sum(map(len, blocks)) if prefill else 0, started)
            return logits

        rendering: dict[Any, float] = {}  # the handler's task -> seconds its call's render took

        def timed_next_call(*args, **kwargs):
            started = time.perf_counter()
            made = next_call(*args, **kwargs)
            seconds = time.perf_counter() - started
            probe.renders.append(seconds)
            rendering[asyncio.current_task()] = seconds  # the event loop's thread renders
            return made

        def timed_run_agents(*args, **kwargs):
            probe.first_request = None
            started = time.perf_counter()
            records = run_agents(*args, **kwargs)
            ended = time.perf_counter()
            first = probe.first_request
            probe.agent_iterations.append(
                {"run_agents_s": ended - started, "until_first_request_s": (first or ended) - started}
            )
            return records

        def recorded_submit(scheduler_self, record, body, *args, **kwargs):
            if probe.first_request is None:
                probe.first_request = time.perf_counter()
            if probe.captured is not None and probe.capture_endpoint in (None, scheduler_self):
                probe.capture_endpoint = scheduler_self  # held: a later endpoint is never taken for it
                probe.captured.append((record.start["rollout_id"], body))
            return submit(scheduler_self, record, body, *args, **kwargs)

        chat, answer = server.Handlers._chat, server.Handlers._answer
        waited: dict[Any, float] = {}  # the handler's task -> seconds its call waited for the engine

        async def timed_answer(handlers, *args, **kwargs):
            started = time.perf_counter()
            try:
                return await answer(handlers, *args, **kwargs)
            finally:  # the wait for the engine: the answer's time less the render within it
                task = asyncio.current_task()
                waited[task] = time.perf_counter() - started - rendering.pop(task, 0.0)

        async def timed_chat(handlers, *args, **kwargs):
            started = time.perf_counter()
            reply = await chat(handlers, *args, **kwargs)
            total = time.perf_counter() - started
            probe.own_call_s.append(total - waited.pop(asyncio.current_task(), 0.0))
            return reply

        server.Handlers._answer = timed_answer
        server.Handlers._chat = timed_chat
        hf.HFEngine._forward = timed_forward
        hf.HFEngine._prefill = timed_prefill
        hf_serve.forward = timed_serving_forward
        scheduler.next_call = timed_next_call
        generate.run_agents = timed_run_agents
        scheduler.Scheduler.submit = recorded_submit

    @contextlib.contextmanager
    def window(self) -> Iterator[dict[str, Any]]:
        """The engine calls, renders and agent iterations of the block, filled in at its end."""
        marks = (len(self.engine_calls), len(self.renders), len(self.agent_iterations), len(self.own_call_s))
        found: dict[str, Any] = {}
        yield found
        found["engine_calls"] = self.engine_calls[marks[0] :]
        found["renders"] = self.renders[marks[1] :]
        found["agent_iterations"] = self.agent_iterations[marks[2] :]
        found["own_call_s"] = self.own_call_s[marks[3] :]


def engine_summary(forwards: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's forward passes: prefills (new tokens after the cache) and decode steps (one token
    per row; rows per step is the batch the decode ran at)."""
    if not forwards:
        return {"forwards": 0}
    decodes = [f for f in forwards if not f["prefill_tokens"]]
    prefills = [f for f in forwards if f["prefill_tokens"]]
    return {
        "forwards": len(forwards),
        "busy_s": round(sum(f["s"] for f in forwards), 2),
        "prefills": len(prefills),
        "prefill_tokens": sum(f["prefill_tokens"] for f in prefills),
        "prefill_s": round(sum(f["s"] for f in prefills), 2),
        "decode_steps": len(decodes),
        "decode_rows": summary([f["rows"] for f in decodes], digits=1) if decodes else {},
        "decode_s": round(sum(f["s"] for f in decodes), 2),
    }


# ---------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------


def manifests(runs: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in runs.glob("*/*/manifest.json")]


def stage_walls(found: list[dict[str, Any]]) -> dict[str, float]:
    walls: dict[str, float] = defaultdict(float)
    for manifest in found:
        if manifest["stage"] != "policy":
            walls[manifest["stage"]] += manifest.get("wall_s") or 0.0
    return {stage: round(seconds, 2) for stage, seconds in sorted(walls.items())}


def failures(runs: Path) -> dict[str, Any]:
    """The failed rollouts of a run, by kind of failure (the text's start): its assign-rewards rows (a
    rollout whose agent failed has its failed row there, and often none in generate-rollouts)."""
    import datasets

    texts = []
    for folder in runs.glob("assign-rewards/*/"):
        rows = datasets.load_from_disk(str(folder))
        texts += [text for text, failed in zip(rows["failure"], rows["failed"]) if failed]
    kinds: dict[str, int] = defaultdict(int)
    for text in texts:
        if "did not return within" in text:
            kinds["timeout"] += 1
        elif "connect" in text.lower():
            kinds["connection"] += 1
        else:
            kinds["other"] += 1
    return {"failed_rows": len(texts), "by_kind": dict(kinds), "examples": sorted(set(texts))[:3]}


def train(probe: Probe, name: str, config_fields: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """rl_training with these fields in a fresh runs directory: its walls, stages, engine calls,
    metrics per iteration."""
    from pipeline.orchestration.flows import rl_training
    from runtime.memory import peak_memory
    from runtime.phases import PHASES
    from schemas.config import RunConfig

    runs = workdir / name
    config = RunConfig(**config_fields, store={"runs_dir": str(runs)})
    sections = {kind: len(PHASES.sections[kind]) for kind in ("iteration", "turn")}
    load_before = loads()
    started = time.perf_counter()
    with probe.window() as seen, peak_memory(interval_s=0.05) as memory:
        results = rl_training(config)
    wall = time.perf_counter() - started
    iterations = PHASES.sections["iteration"][sections["iteration"] :]
    turns = PHASES.sections["turn"][sections["turn"] :]
    found = manifests(runs)
    generation = defaultdict(float)
    for manifest in found:
        if manifest["stage"] == "generate-rollouts":
            generation[manifest["iteration"]] += manifest["wall_s"]
    metrics = [result["metrics"] for result in results]
    report = {
        "config": dict(config_fields),
        "runs_dir": str(runs),
        "load_average_before_after": [load_before, loads()],
        "wall_s": round(wall, 2),
        "iteration_wall_s": [round(section["wall_s"], 2) for section in iterations],
        "rollout_phase_s": round(sum(turn["wall_s"] for turn in turns), 2),  # the turns of every iteration
        "turns": len(turns),
        "generation_s": round(sum(generation.values()), 2),
        "generation_s_per_iteration": [round(generation[i], 2) for i in sorted(generation)],
        "stage_wall_s": stage_walls(found),
        "engine": engine_summary(seen["engine_calls"]),
        "engine_busy_share_of_rollout_phase": round(
            sum(c["s"] for c in seen["engine_calls"]) / max(sum(turn["wall_s"] for turn in turns), 1e-9), 3
        ),
        "model_calls": round(sum(m["mean_turns"] * m["rollouts"] for m in metrics)),
        "success_rate": [round(m["success_rate"], 4) for m in metrics],
        "reward_mean": [round(m["reward_mean"], 4) for m in metrics],
        "mean_turns": [round(m["mean_turns"], 3) for m in metrics],
        "truncation_rate": [round(m["truncation_rate"], 4) for m in metrics],
        "failed_rate": [round(m["failed_rate"], 4) for m in metrics],
        "policies": [result["policy"] for result in results],
        "peak_rss_mb": memory["peak_rss_mb"],  # this process: mtrl's (the agents run in a child)
        "failures": failures(runs),
    }
    if seen["renders"]:
        report["render_ms"] = summary(seen["renders"], 1000)
    if seen["own_call_s"]:  # chat completions: the handler's time less its call's wait for the engine
        report["endpoint_own_ms_per_call"] = summary(seen["own_call_s"], 1000)
    if seen["agent_iterations"]:
        report["agents_process"] = {
            "until_first_request_s": summary([i["until_first_request_s"] for i in seen["agent_iterations"]]),
            "run_agents_s": summary([i["run_agents_s"] for i in seen["agent_iterations"]]),
        }
    print(f"[{name}] wall {report['wall_s']} s, generation {report['generation_s']} s, engine {report['engine']}")
    return report


# ---------------------------------------------------------------------------------------
# (i) the endpoint's cost per call: a replay of one iteration's requests
# ---------------------------------------------------------------------------------------


def replay_endpoint(
    probe: Probe, captured: list[tuple[int, dict[str, Any]]], runs: Path, config_fields: dict[str, Any]
) -> dict[str, Any]:
    """The captured requests of iteration 0, one at a time against a fresh Endpoint on iteration 0's
    policy: first sampled (their render times), then sent again, identical (answered from the
    record: the round trip without the model), over httpx and through an openai.AsyncOpenAI per
    rollout (as agents call), each on a kept-alive connection (a warm-up request first)."""
    import httpx
    import openai

    from pipeline.orchestration.stage_runs import settings_of
    from schemas.config import RunConfig
    from stages.generate_rollouts import rollout_starts, sampling_seed
    from stages.generate_rollouts.agents.endpoint import Endpoint
    from stages.generate_rollouts.agents.record import RolloutRecord
    from stages.generate_rollouts.engine import open_engine
    from stages.policy.loading import load_tokenizer

    config = RunConfig(**config_fields, store={"runs_dir": str(runs)})
    settings = settings_of("generate-rollouts", config)
    first_turn = next(m for m in manifests(runs) if m["stage"] == "generate-rollouts" and m["iteration"] == 0)
    policy_dir = runs / "policy" / first_turn["parents"]["policy"]
    tokenizer = load_tokenizer(str(policy_dir))
    engine = open_engine(policy_dir, tokenizer, settings.engine)
    starts = rollout_starts(settings, 0)
    records = {start["rollout_id"]: RolloutRecord(start, settings.call_limit(start["task"])) for start in starts}
    requests = captured
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
    route = "/v1/chat/completions"
    passes: dict[str, list[float]] = defaultdict(list)

    def over_httpx(kind: str) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as http:
            http.post(f"{endpoint.base_url}/rollouts/{requests[0][0]}{route}", json=requests[0][1], timeout=120)
            for rollout_id, body in requests:
                started = time.perf_counter()
                answer = http.post(f"{endpoint.base_url}/rollouts/{rollout_id}{route}", json=body, timeout=120)
                passes[kind].append(time.perf_counter() - started)
                answer.raise_for_status()

    async def through_openai(kind: str) -> None:
        clients = {
            rollout_id: openai.AsyncOpenAI(
                base_url=f"{endpoint.base_url}/rollouts/{rollout_id}/v1", api_key=KEY, max_retries=0
            )
            for rollout_id in records
        }
        retry = {"x-stainless-retry-count": "1"}  # as the openai client marks a retry (its first attempt: a new call)
        for rollout_id, body in {rollout_id: body for rollout_id, body in requests}.items():
            await clients[rollout_id].chat.completions.create(**body, extra_headers=retry)  # the connection, kept alive
        for rollout_id, body in requests:
            started = time.perf_counter()
            await clients[rollout_id].chat.completions.create(**body, extra_headers=retry)
            passes[kind].append(time.perf_counter() - started)

    with endpoint, probe.window() as seen:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as http:
            for rollout_id, body in requests:  # sampled: each call made, one at a time
                started = time.perf_counter()
                http.post(f"{endpoint.base_url}/rollouts/{rollout_id}{route}", json=body, timeout=120)
                passes["sampled"].append(time.perf_counter() - started)
        calls_made = sum(len(record.calls) for record in records.values())
        over_httpx("httpx")
        asyncio.run(through_openai("openai"))
        sampled_again = sum(len(record.calls) for record in records.values()) - calls_made
    return {
        "requests": len(requests),
        "rollouts": len(records),
        "render_ms": summary(seen["renders"], 1000),
        "sampled_one_at_a_time_ms": summary(passes["sampled"], 1000),
        "engine_of_sampled_pass": engine_summary(seen["engine_calls"]),
        "retried_round_trip_ms": {
            "httpx": summary(passes["httpx"], 1000),
            "async_openai_client": summary(passes["openai"], 1000),
        },
        "retries_sampled_again": sampled_again,  # 0: every retry was answered from the record
    }


def agent_fixed_costs(rollouts: int) -> dict[str, Any]:
    """What an agent iteration pays before its first model call: the agents' process (python
    stages/generate_rollouts/agents/child.py, importing the agent module; no rollout), and building an
    openai.AsyncOpenAI per rollout: as written (each loads a TLS context), on one shared httpx client (whose
    pool every request then scans whole), and as AgentRollout.client does (an httpx client each, one TLS
    context)."""
    spec = {
        "function": DEMO_AGENT,
        "base_url": "http://127.0.0.1:9",
        "api_key": KEY,
        "model": "policy",
        "concurrency": 1,
        "timeout_s": 1.0,
        "rollouts": [],
    }
    from runtime.piped_process import EXITED, run_piped, start_piped
    from stages.generate_rollouts.agents.run import CHILD

    starts = []
    for _ in range(3):
        started = time.perf_counter()
        process = start_piped([sys.executable, CHILD], dict(os.environ), cwd=str(REPO))
        *_, last = run_piped(process, (json.dumps(spec) + "\n").encode())
        assert last[-1] == (EXITED, 0), last  # the empty run ended cleanly
        starts.append(time.perf_counter() - started)
    probe = (
        "import time, openai, httpx\n"
        "from stages.generate_rollouts.agents.child import AgentRollout\n"
        f"n = {rollouts}\n"
        "url = 'http://127.0.0.1:9/rollouts/{}/v1'\n"
        "t = time.perf_counter()\n"
        "[openai.AsyncOpenAI(base_url=url.format(i), api_key='k') for i in range(n)]\n"
        "own = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        "shared = httpx.AsyncClient()\n"
        "[openai.AsyncOpenAI(base_url=url.format(i), api_key='k', http_client=shared) for i in range(n)]\n"
        "one_pool = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        "tls = httpx.create_ssl_context()\n"
        "[AgentRollout(i, {}, [], [], url.format(i), 'k', 'policy', _tls=tls).client for i in range(n)]\n"
        "print(own, one_pool, time.perf_counter() - t)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    own, one_pool, per_rollout = map(float, done.stdout.split())
    return {
        "agents_process_empty_run_s": summary(starts),
        "clients": rollouts,
        "async_openai_clients_s": round(own, 3),
        "async_openai_clients_one_shared_httpx_s": round(one_pool, 3),
        "agent_rollout_clients_s": round(per_rollout, 3),
    }


# ---------------------------------------------------------------------------------------
# (ii) slow tools: where lock-step waits
# ---------------------------------------------------------------------------------------


def warm_tool_workers(count: int) -> float:
    """Start `count` tool workers now (the pool keeps them), as a process that ran a turn before
    has them: the native run's first turn then does not start them. Returns the seconds."""
    from stages.execute_tools.calls import ToolCall, run_tool_calls
    from stages.tools import TOOLS

    calls = [ToolCall("calculate", {"expression": f"{i}+1"}, None, str(i)) for i in range(count)]
    started = time.perf_counter()
    run_tool_calls(calls, {"calculate": TOOLS["calculate"]}, timeout_s=60.0)
    return time.perf_counter() - started


def tool_latency_floors(runs: Path) -> dict[str, Any]:
    """From the stored execute-tools rows: every guess the rollouts made with its latency. The
    floor of lock-step is the sum over turns of each turn's slowest guess; the floor of rollouts on
    their own is the longest rollout's sum of guesses."""
    import datasets

    from bench.agent_bench_tasks import latency

    slowest: dict[int, float] = defaultdict(float)  # turn -> its slowest guess
    per_rollout: dict[int, float] = defaultdict(float)
    turn_walls: dict[int, float] = {}
    guesses = 0
    for manifest in manifests(runs):
        if manifest["stage"] != "execute-tools":
            continue
        turn_walls[manifest["turn"]] = manifest["wall_s"]
        rows = datasets.load_from_disk(str(runs / "execute-tools" / manifest["version"]))
        for task, rollout_id, calls in zip(rows["task_payload"], rows["rollout_id"], rows["tool_calls"]):
            for call in calls:
                arguments = json.loads(call["arguments"]) if call["arguments"] else {}
                if call["name"] != "guess" or set(arguments) != {"number"} or type(arguments["number"]) is not int:
                    continue  # refused before it runs: no latency
                seconds = latency(json.loads(task), arguments["number"])
                slowest[manifest["turn"]] = max(slowest[manifest["turn"]], seconds)
                per_rollout[rollout_id] += seconds
                guesses += 1
    return {
        "guesses": guesses,
        "lock_step_floor_s": round(sum(slowest.values()), 2),  # every turn waits for its slowest guess
        "on_their_own_floor_s": round(max(per_rollout.values(), default=0.0), 2),  # the longest rollout
        "mean_latency_per_rollout_s": round(statistics.fmean(per_rollout.values()), 2) if per_rollout else 0.0,
        # natively, each execute-tools turn's wall against its slowest guess: the tools of a turn ran
        # at once when the wall exceeds the slowest by little (the rest is the stage's own work)
        "execute_tools_wall_minus_slowest_guess_s": summary([turn_walls[t] - slowest.get(t, 0.0) for t in turn_walls]),
        "execute_tools_turns": [
            {"turn": t, "wall_s": round(turn_walls[t], 3), "slowest_guess_s": round(slowest.get(t, 0.0), 3)}
            for t in sorted(turn_walls)
        ],
    }


def rows_by_key(runs: Path, stage: str, columns: tuple[str, ...]) -> dict[tuple[int, int, int], tuple]:
    """A stage's rows of a run by (iteration, rollout, turn): these columns."""
    import datasets

    found = {}
    for manifest in manifests(runs):
        if manifest["stage"] != stage:
            continue
        rows = datasets.load_from_disk(str(runs / stage / manifest["version"]))
        for rollout_id, turn, *values in zip(*(rows[name] for name in ("rollout_id", "turn", *columns))):
            found[(manifest["iteration"], rollout_id, turn)] = tuple(values)
    return found


def compared(native: Path, agent: Path) -> dict[str, Any]:
    """The two runs side by side. Tokens: the turns whose stored tokens are the same (the context's
    new tokens, the completion, the stream offset), per iteration. Rewards: per iteration, the
    rollouts whose final reward or stop reason differ, and the first ones with how their last turn
    finished (an iteration's differences change the update, so every later iteration differs)."""
    columns = ("context_token_ids", "completion_token_ids", "stream_offset")
    mine, theirs = (rows_by_key(runs, "generate-rollouts", columns) for runs in (native, agent))
    same, total = defaultdict(int), defaultdict(int)
    for key, tokens in mine.items():
        total[key[0]] += 1
        same[key[0]] += tokens == theirs.get(key)
    ended = ("reward", "stop_reason", "finish_reason")
    last = []
    for runs in (native, agent):
        rows = rows_by_key(runs, "assign-rewards", ended)
        final = {}
        for (iteration, rollout_id, turn), values in sorted(rows.items()):
            final[(iteration, rollout_id)] = (turn, *values)  # sorted: the last turn stays
        last.append(final)
    differing = defaultdict(list)
    for key, (turn, *values) in last[0].items():
        other = last[1].get(key)
        if other is None or (values[0], values[1]) != (other[1], other[2]):
            differing[key[0]].append(
                {
                    "rollout": key[1],
                    "native": dict(zip(("turn", *ended), (turn, *values))),
                    "agent": None if other is None else dict(zip(("turn", *ended), other)),
                }
            )
    first = min(differing, default=None)
    return {
        "turns": {"native": len(mine), "agent": len(theirs), "identical": sum(same.values())},
        "identical_turns_per_iteration": [[same[i], total[i]] for i in sorted(total)],
        "rollouts_with_other_reward_or_end_per_iteration": [len(differing[i]) for i in sorted(total)],
        "first_iteration_with_a_difference": first,
        "its_differences": differing[first][:5] if first is not None else [],
    }


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10, help="of the demo runs (i, iii)")
    parser.add_argument("--rollouts", type=int, default=64, help="of the demo runs")
    parser.add_argument("--guess-rollouts", type=int, default=64, help="of the slow-guess runs (ii)")
    parser.add_argument("--slow-repeats", type=int, default=2, help="slow-guess pairs (native, agent), interleaved")
    parser.add_argument(
        "--native-default-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also one native slow-guess run with runner.max_workers at its default",
    )
    parser.add_argument("--parts", default="demo,slow,scale", help="demo (i, iii), slow (ii), scale (iv)")
    parser.add_argument("--scale-rollouts", default="1024,4096", help="of the scale part's runs (iv)")
    parser.add_argument("--sync-rollouts", type=int, default=1024, help="of the scale part's sync agent (iv)")
    parser.add_argument("--out", type=Path, default=RESULTS / "agents_cpu.json")
    args = parser.parse_args()
    os.chdir(REPO)  # the agents' process and the plugins import from the working directory
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    parts = set(args.parts.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-bench-agents-"))
    probe = Probe()
    probe.install()
    report: dict[str, Any] = {
        "question": "agent programs against the native loop: the endpoint's cost, lock-step with slow tools, "
        "the learning curve through the agent",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_before": loads(),
        "threads": "runner.threads unset (a user's default)",
    }

    if "demo" in parts:
        demo = {"iterations": args.iterations, "task": {"rollouts": args.rollouts}}
        native = train(probe, "demo-native", demo, workdir)
        probe.captured = []  # the requests of the agent run's first iteration, for the replay
        agent_fields = {**demo, "agent": {"function": DEMO_AGENT}}
        agent = train(probe, "demo-agent", agent_fields, workdir)
        captured, probe.captured = probe.captured, None
        replay = replay_endpoint(probe, captured, Path(agent["runs_dir"]), agent_fields)
        fixed = agent_fixed_costs(args.rollouts)
        agent_calls = agent["model_calls"]
        report["demo"] = {
            "settings": {
                "task": "calculator",
                "rollouts": args.rollouts,
                "group_size": 8,
                "iterations": args.iterations,
                "engine": "hf",
                "agent": DEMO_AGENT,
            },
            "native": native,
            "agent": agent,
            "agent_over_native": {
                "wall": round(agent["wall_s"] / native["wall_s"], 3),
                "generation": round(agent["generation_s"] / native["generation_s"], 3),
            },
            # the agent iteration's generation beyond the native one's, per model call
            "extra_generation_ms_per_call": round(
                1000 * (agent["generation_s"] - native["generation_s"]) / max(agent_calls, 1), 2
            ),
            "endpoint_replay": replay,
            "agent_fixed_costs": fixed,
            "learning_curve": {
                "success_rate_native": native["success_rate"],
                "success_rate_agent": agent["success_rate"],
                "identical": native["success_rate"] == agent["success_rate"],
            },
            "native_against_agent": compared(Path(native["runs_dir"]), Path(agent["runs_dir"])),
        }
        print(json.dumps({k: v for k, v in report["demo"].items() if k not in ("native", "agent")}, indent=2))

    if "slow" in parts:
        from bench.agent_bench_tasks import MAX_LATENCY_S

        rollouts = args.guess_rollouts
        task = {"name": "slow-guess", "rollouts": rollouts, "plugins": [PLUGIN]}
        runner = {"max_workers": rollouts}  # every rollout's tool of a turn at once (the default is 8)
        cold = warm_tool_workers(rollouts)
        pairs = []
        for repeat in range(args.slow_repeats):  # interleaved: native, agent, native, agent
            native = train(probe, f"slow-native-{repeat}", {"iterations": 1, "task": task, "runner": runner}, workdir)
            agent_fields = {"iterations": 1, "task": task, "runner": runner, "agent": {"function": GUESS_AGENT}}
            agent = train(probe, f"slow-agent-{repeat}", agent_fields, workdir)
            pairs.append(
                {
                    "native": native,
                    "agent": agent,
                    "agent_over_native": {
                        "rollout_phase": round(agent["rollout_phase_s"] / native["rollout_phase_s"], 3),
                        "iteration": round(agent["iteration_wall_s"][0] / native["iteration_wall_s"][0], 3),
                    },
                }
            )
        # the native loop as a user gets it without setting runner.max_workers (8 tools at a time)
        throttled = None
        if args.native_default_workers:
            throttled = train(probe, "slow-native-default-workers", {"iterations": 1, "task": task}, workdir)
        first = pairs[0]
        report["slow_tools"] = {
            "settings": {
                "task": f"slow-guess (guess-number, the guess tool answers after a seeded 0-{MAX_LATENCY_S:g} s)",
                "rollouts": rollouts,
                "group_size": 8,
                "iterations": 1,
                "seed": 0,
                "repeats": args.slow_repeats,
                "native_runner_max_workers": rollouts,
                "runner_max_workers_default": 8,
                "agent": GUESS_AGENT,
            },
            "tool_workers_cold_start_s": round(cold, 2),
            "agent_over_native": {
                kind: {
                    "each": [pair["agent_over_native"][kind] for pair in pairs],
                    "mean": round(statistics.fmean(pair["agent_over_native"][kind] for pair in pairs), 3),
                }
                for kind in ("rollout_phase", "iteration")
            },
            "tool_latency_floors": {
                "native": tool_latency_floors(Path(first["native"]["runs_dir"])),
                "agent": {
                    key: value
                    for key, value in tool_latency_floors(Path(first["agent"]["runs_dir"])).items()
                    if not key.startswith("execute_tools")  # its tools ran in the agent, not in execute-tools
                },
            },
            "native_against_agent": compared(Path(first["native"]["runs_dir"]), Path(first["agent"]["runs_dir"])),
            "runs": pairs,
            "native_default_max_workers": throttled,
        }
        if throttled is not None:  # the agent path against that loop, per agent run
            report["slow_tools"]["agent_over_native_default_max_workers"] = {
                kind: [
                    round(pair["agent"][key] / throttled[key], 3)
                    if kind == "rollout_phase"
                    else round(pair["agent"]["iteration_wall_s"][0] / throttled["iteration_wall_s"][0], 3)
                    for pair in pairs
                ]
                for kind, key in (("rollout_phase", "rollout_phase_s"), ("iteration", "iteration_wall_s"))
            }
        print(json.dumps({k: v for k, v in report["slow_tools"].items() if k != "runs"}, indent=2))

    if "scale" in parts:
        # imports, the policy's load and the first agents' process are paid here, by neither side's runs
        warm_up = {"iterations": 1, "task": {"rollouts": 16}}
        train(probe, "scale-warm-up-native", warm_up, workdir)
        train(probe, "scale-warm-up-agent", {**warm_up, "agent": {"function": DEMO_AGENT}}, workdir)
        runs = {}
        for rollouts in map(int, args.scale_rollouts.split(",")):
            work = {"iterations": 1, "task": {"rollouts": rollouts}}
            native = train(probe, f"scale-native-{rollouts}", work, workdir)
            agent = train(probe, f"scale-agent-{rollouts}", {**work, "agent": {"function": DEMO_AGENT}}, workdir)
            runs[rollouts] = {
                "native": native,
                "agent": agent,
                "agent_over_native": {
                    "wall": round(agent["wall_s"] / native["wall_s"], 3),
                    "rollout_phase": round(agent["rollout_phase_s"] / native["rollout_phase_s"], 3),
                },
                "same_success": native["success_rate"] == agent["success_rate"],
            }
        sync_work = {"iterations": 1, "task": {"rollouts": args.sync_rollouts}}
        sync_agent = {"function": SYNC_AGENT, "concurrency": 0}  # a thread per rollout
        sync = train(probe, f"scale-sync-{args.sync_rollouts}", {**sync_work, "agent": sync_agent}, workdir)
        report["scale"] = {
            "settings": {
                "task": "calculator (the demo's work), 1 iteration, the hf engine, the embedded tiny model",
                "agent": DEMO_AGENT,
                "sync_agent": f"{SYNC_AGENT} at agent.concurrency 0",
                "agent_timeout_s": "the default",
            },
            "openai_client_agent": {str(size): run for size, run in runs.items()},
            "sync_httpx_agent": sync,
        }
        print(
            json.dumps(
                {
                    **{
                        size: {
                            "agent_over_native": run["agent_over_native"],
                            "same_success": run["same_success"],
                            "failures": run["agent"]["failures"],
                            "endpoint_own_ms_per_call": run["agent"].get("endpoint_own_ms_per_call"),
                            "peak_rss_mb": run["agent"]["peak_rss_mb"],
                        }
                        for size, run in runs.items()
                    },
                    "sync": {key: sync.get(key) for key in ("wall_s", "failures", "endpoint_own_ms_per_call")},
                },
                indent=2,
            )
        )

    report["ended_at"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report["load_average_after"] = loads()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
