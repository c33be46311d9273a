"""`mtrl view`: an iteration's rollouts in the browser, read from the store (docs/viewer.md).

`iteration_view(store, iteration)` turns the stored turns of one iteration into a JSON-able dict
(groups -> rollouts -> turns, with each completion token's id, text, logprob and advantage);
`page(view)` puts that dict into one self-contained HTML file (pipeline/monitoring/viewer_page/viewer.html:
vanilla JS, no network), which `write_page` saves and `serve` answers on 127.0.0.1.

Nothing is recomputed: no model runs. The policy that generated the rollouts lends its tokenizer
only to decode the stored token ids into text.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pipeline.store.lineage import generating_policy
from pipeline.store.versions import Store
from schemas.features import agent_state
from schemas.manifest import Manifest, StoreError
from schemas.stage import POLICY
from schemas.token_stream import rollouts
from stages.policy.loading import load_tokenizer

PAGE = Path(__file__).parent / "viewer_page" / "viewer.html"
DATA_MARK = "/*MTRL_VIEW_DATA*/"  # where page() puts the view's JSON in viewer.html
# What the viewer reads, best first: both hold every turn of an iteration with its reward;
# compute-advantages also holds the advantages (a run stopped before it still shows its rollouts).
TURN_STAGES = ("compute-advantages", "assign-rewards")
# An iteration's agents' log, as stages/generate_rollouts/agents/run.py writes it: each run of the
# iteration's agents starts with a line of its own (a resumed run appends one), and the agents' process
# tags a rollout's lines (agents/child.py); what its subprocesses write is untagged.
AGENTS_LOG = "logs/agents-{iteration}.log"
AGENTS_LOG_START = "=== agents of iteration "
AGENTS_LOG_LINE = re.compile(r"\[rollout (\d+)\] (.*)")
LOG_LINES_SHOWN = 200  # a rollout's last lines: a chatty agent's page stays light


def iteration_sources(store: Store) -> dict[int, Manifest]:
    """The version the viewer reads for each iteration of the store: its newest compute-advantages,
    else its newest assign-rewards."""
    found: dict[int, Manifest] = {}
    for stage in reversed(TURN_STAGES):  # the better stage's versions overwrite the other's
        for manifest in store.versions(stage):  # oldest first: the newest is kept
            found[manifest.iteration] = manifest
    return dict(sorted(found.items()))


@functools.lru_cache(maxsize=8)
def _tokenizer(policy_dir: Path) -> Any:
    return load_tokenizer(policy_dir)


def _number(value: float | None) -> float | None:
    """A float for JSON: rounded (the page shows 4 decimals), NaN (a failed rollout's reward) as null."""
    return None if value is None or not math.isfinite(value) else round(float(value), 4)


def agent_log_lines(path: Path) -> dict[int, list[str]]:
    """Each rollout's lines in an iteration's agents' log, their tag taken off, from the log's last run
    of the iteration's agents (the one whose rows a resumed run stored); {} without a log."""
    found: dict[int, list[str]] = defaultdict(list)
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8", errors="replace") as log:
        for line in log:
            if line.startswith(AGENTS_LOG_START):
                found.clear()
            elif tagged := AGENTS_LOG_LINE.match(line):
                found[int(tagged[1])].append(tagged[2])
    return dict(found)


def iteration_view(store: Store, iteration: int | None = None) -> dict[str, Any]:
    """One iteration of the store (default: the last) as a JSON-able dict: its rollouts by group,
    each turn's chat (context, thinking, content, tool calls, what the environment or the agent
    added) and completion tokens (id, logprob, advantage), the texts of those tokens by id."""
    sources = iteration_sources(store)
    if not sources:
        raise StoreError(f"no {' or '.join(TURN_STAGES)} version in {store.root}: no iteration to view")
    iteration = max(sources) if iteration is None else iteration
    if iteration not in sources:
        raise StoreError(f"no iteration {iteration} in {store.root}; iterations: {', '.join(map(str, sources))}")
    manifest = sources[iteration]
    turns = store.load(manifest.stage, manifest.version)
    policy = generating_policy(store, manifest.stage, manifest.version)
    # The tokenizer's files only: store.policy_dir would hash the weights too, which decoding never reads.
    tokenizer = _tokenizer(store.path(POLICY, policy))
    columns = turns.to_dict()
    has_advantages = "advantages" in columns

    agents_log = store.root / AGENTS_LOG.format(iteration=iteration)
    logged = agent_log_lines(agents_log)
    token_text: dict[str, str] = {}
    by_group: dict[int, list[dict[str, Any]]] = defaultdict(list)
    group_tasks: dict[int, dict[str, Any]] = {}
    for rollout in rollouts(turns):
        first = rollout.rows[0]
        group_id = columns["group_id"][first]
        group_tasks.setdefault(
            group_id,
            {
                "group_id": group_id,
                "task": columns["task"][first],
                "task_id": columns["task_id"][first],
                "task_payload": json.loads(columns["task_payload"][first] or "{}"),
            },
        )
        shown_turns = []
        for position, row in enumerate(rollout.rows):
            completion = columns["completion_token_ids"][row]
            for token in completion:  # JSON's keys are strings
                if str(token) not in token_text:
                    token_text[str(token)] = tokenizer.decode([token])
            recorded = agent_state(columns["env_state"][row])
            shown_turns.append(
                {
                    "turn": columns["turn"][row],
                    "new_segment": position > 0 and position in rollout.segment_starts,
                    "context": tokenizer.decode(columns["context_token_ids"][row]),
                    "context_tokens": len(columns["context_token_ids"][row]),
                    "thinking": columns["thinking"][row] or "",
                    "content": columns["content"][row] or "",
                    "finish_reason": columns["finish_reason"][row],
                    "tool_calls": columns["tool_calls"][row],
                    # an agent's turn: the messages it sent before its next call; a native one: the
                    # environment's reply as the tokens the chat template appended
                    "messages": recorded["added_messages"] if recorded else None,
                    "observation": columns["observation"][row] or "",
                    "turn_reward": _number(columns["turn_reward"][row]),
                    "token_ids": completion,
                    "logprobs": [_number(value) for value in columns["completion_logprobs"][row]],
                    "advantages": [_number(value) for value in columns["advantages"][row]] if has_advantages else None,
                }
            )
        last = rollout.rows[-1]
        advantages = [value for turn in shown_turns for value in turn["advantages"] or []]
        by_group[group_id].append(
            {
                "rollout_id": rollout.rollout_id,
                "agent": any(agent_state(columns["env_state"][row]) for row in rollout.rows),
                "reward": _number(columns["reward"][last]),
                # GRPO-like estimators give every token of a rollout one advantage; GAE's vary per token
                "advantage": _number(sum(advantages) / len(advantages)) if advantages else None,
                "stop_reason": columns["stop_reason"][last],
                "failed": rollout.failed,
                "failure": next((columns["failure"][row] for row in rollout.rows if columns["failure"][row]), None),
                "segments": len(rollout.segment_starts),
                "turns": shown_turns,
                # what its agent printed and logged (the agents' log, by its tag): the last lines, and how many
                "log": logged.get(rollout.rollout_id, [])[-LOG_LINES_SHOWN:],
                "log_lines": len(logged.get(rollout.rollout_id, [])),
            }
        )

    groups = [{**group_tasks[group_id], "rollouts": by_group[group_id]} for group_id in sorted(by_group)]
    every = [rollout for group in groups for rollout in group["rollouts"]]
    rewards = [rollout["reward"] for rollout in every if rollout["reward"] is not None]
    all_advantages = [value for row in columns.get("advantages", []) for value in row]
    return {
        "runs_dir": str(store.root),
        "iteration": iteration,
        "agents_log": str(agents_log) if agents_log.is_file() else None,
        "iterations": list(sources),
        "source": f"{manifest.stage}/{manifest.version}",
        "policy": policy,
        "estimator": manifest.config.get("advantage", {}).get("estimator") if has_advantages else None,
        "rollouts": len(every),
        "failed": sum(rollout["failed"] for rollout in every),
        "reward_mean": _number(sum(rewards) / len(rewards)) if rewards else None,
        # the colour scale's end: the same for every rollout, so colours compare across the page
        "max_abs_advantage": _number(max(map(abs, all_advantages), default=0.0)),
        "token_text": token_text,
        "groups": groups,
    }


def page(view: dict[str, Any], linked: bool = False) -> str:
    """The viewer's HTML with this view in it. `linked`: served, so the other iterations are links
    (a static file holds one iteration)."""
    # As JSON inside <script>: every <, > and & escaped, so no text can close the element
    data = json.dumps({**view, "linked": linked}, ensure_ascii=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return PAGE.read_text().replace(DATA_MARK, data)


def write_page(store: Store, iteration: int | None, out: Path) -> Path:
    """One iteration's page as a single static HTML file (it opens from file://, offline)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(iteration_view(store, iteration)))
    return out


def serve(store: Store, port: int, iteration: int | None = None) -> None:
    """Serve the pages on http://127.0.0.1:PORT/ (?iteration=N picks one; port 0: a free port) until
    Ctrl-C, after printing the address. Each request reads the store again, so the iterations a
    running training adds show up."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            asked = parse_qs(url.query).get("iteration", [None])[0]
            try:
                if url.path != "/":
                    raise LookupError(f"no page at {url.path}: the viewer is at /")
                if asked is not None and not asked.isdigit():
                    raise LookupError(f"?iteration={asked} is not an iteration number")
                chosen = iteration if asked is None else int(asked)
                body, status = page(iteration_view(store, chosen), linked=True), 200
            except (LookupError, StoreError) as exc:
                body, status = f"mtrl view: {exc}\n", 404
            encoded = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            self.wfile.write(encoded)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the address line

    iteration_view(store, iteration)  # nothing to view, or no such iteration: an error before serving
    server = HTTPServer(("127.0.0.1", port), Handler)
    print(f"mtrl view: http://127.0.0.1:{server.server_port}/ ({store.root}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
