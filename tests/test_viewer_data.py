"""`mtrl view`'s data (pipeline/monitoring/viewer.py): an iteration of a store read into the page's JSON, and the
page that carries it. The browser's side is tests/test_viewer.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from pipeline.models.base_model import EMBEDDED_POLICY
from pipeline.monitoring.viewer import DATA_MARK, LOG_LINES_SHOWN, PAGE, iteration_view, page
from pipeline.store.versions import Store
from schemas.features import AGENT_STATE, COMPUTE_ADVANTAGES, GENERATE_ROLLOUTS, dataset_from_rows
from schemas.manifest import StoreError
from schemas.stage import POLICY
from stages.policy.loading import load_tokenizer

MARKUP = "<img src=x onerror=alert(1)> 2+2 is 4"  # what a model may write: shown as text, never parsed
TOOL_RESULT = "</script><b>4</b>"
FAILURE = "the agent raised RuntimeError: boom <i>here</i>"
LOG_MARKUP = "<b>printed</b> by the agent"


def _turn(tokenizer, rollout_id: int, turn: int, content: str, advantage: float, **row) -> dict:
    completion = tokenizer.encode(content + tokenizer.eos_token, add_special_tokens=False)
    return {
        "rollout_id": rollout_id,
        "group_id": 0,
        "task": "calculator",
        "task_id": "calculator-0-0",
        "task_payload": json.dumps({"question": "What is 2+2?", "answer": 4}),
        "env_state": "{}",
        "iteration": 0,
        "turn": turn,
        "stream_offset": 0,
        "context_token_ids": tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False),
        "completion_token_ids": completion,
        "completion_logprobs": [-0.1 * position for position in range(len(completion))],
        "finish_reason": "stop",
        "thinking": "",
        "content": content,
        "failed": False,
        "tool_calls": [],
        "observation": "",
        "observation_token_ids": [],
        "turn_reward": 0.0,
        "advantages": [advantage] * len(completion),
        **row,
    }


def hand_built_store(root: Path) -> Store:
    """A store of one iteration written by hand, no model run: a policy (the embedded model's tokenizer),
    a generate-rollouts version naming it, and a compute-advantages version of one group: rollout 0
    native, its text markup; rollout 1 an agent's, two segments, a tool result of markup; rollout 2
    failed. The iteration's agents' log (agents_log_text) has lines of rollouts 1 and 2."""
    store = Store(root)
    tokenizer = load_tokenizer(EMBEDDED_POLICY)

    def tokenizer_files(folder: Path) -> dict:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
            shutil.copy(EMBEDDED_POLICY / name, folder / name)
        return {}

    store.write(POLICY, "p0", tokenizer_files, {"iteration": -1})
    store.write_dataset(
        "generate-rollouts",
        "g0",
        dataset_from_rows([], GENERATE_ROLLOUTS),
        {"parents": {POLICY: "p0"}},
        GENERATE_ROLLOUTS,
    )

    def agent(added: list[dict], end: dict | None) -> str:
        return json.dumps({AGENT_STATE: {"observation_token_ids": [], "added_messages": added, "end": end}})

    done = {"stop_reason": "done", "failure": None, "reward": None}
    rows = [
        _turn(tokenizer, 0, 0, MARKUP, 1.0, reward=1.0, stop_reason="done", terminated=True),
        _turn(
            tokenizer,
            1,
            0,
            "I call the tool.",
            -1.0,
            reward=0.0,
            env_state=agent([{"role": "tool", "content": TOOL_RESULT, "tool_call_id": "call_1_0_0"}], None),
        ),
        _turn(tokenizer, 1, 1, "4", -1.0, reward=0.0, env_state=agent([], done), stop_reason="done"),
        _turn(tokenizer, 2, 0, "", 0.0, reward=math.nan, failed=True, failure=FAILURE, stop_reason="failed"),
    ]
    dataset = dataset_from_rows(rows, COMPUTE_ADVANTAGES)
    manifest = {"parents": {"generate-rollouts": "g0"}, "iteration": 0, "config": {"advantage": {"estimator": "grpo"}}}
    store.write_dataset("compute-advantages", "c0", dataset, manifest, COMPUTE_ADVANTAGES)
    (root / "logs").mkdir()
    (root / "logs" / "agents-0.log").write_text(agents_log_text())
    return store


def agents_log_text() -> str:
    """An agents' log as stages/generate_rollouts/agents/run.py and child.py write it: two runs of
    iteration 0's agents (the first interrupted: a resumed run appends), tagged lines and untagged ones."""
    return "\n".join(
        [
            "=== agents of iteration 0: process 10 of /usr/bin/python3, 2026-11-28 10:00:00 ===",
            "[rollout 1] a line of the interrupted run",
            "=== agents of iteration 0: process 11 of /usr/bin/python3, 2026-11-28 10:05:00 ===",
            "[rollout 1] hello",
            "a subprocess's line: untagged",
            f"[rollout 1] {LOG_MARKUP}",
            "[rollout 12] a line of another rollout",
            "[rollout 1]without the tag's space: not the rollout's",
            *(f"[rollout 2] line {n}" for n in range(LOG_LINES_SHOWN + 5)),
            "",
        ]
    )


def test_an_iteration_is_read_by_group_with_its_turns_tokens_segments_and_failures(tmp_path):
    view = iteration_view(hand_built_store(tmp_path))
    assert json.loads(json.dumps(view, allow_nan=False)) == view  # plain JSON, as the page parses it
    assert (view["iteration"], view["iterations"], view["source"]) == (0, [0], "compute-advantages/c0")
    assert (view["policy"], view["estimator"], view["rollouts"], view["failed"]) == ("p0", "grpo", 3, 1)
    assert view["reward_mean"] == 0.5 and view["max_abs_advantage"] == 1.0
    (group,) = view["groups"]
    assert group["task_payload"] == {"question": "What is 2+2?", "answer": 4}
    native, agent, failed = group["rollouts"]

    (turn,) = native["turns"]
    assert "".join(view["token_text"][str(token)] for token in turn["token_ids"]) == MARKUP + "<|im_end|>"
    assert len(turn["logprobs"]) == len(turn["advantages"]) == len(turn["token_ids"])
    assert turn["logprobs"][1] == -0.1 and set(turn["advantages"]) == {1.0}
    assert (native["reward"], native["advantage"], native["agent"], turn["messages"]) == (1.0, 1.0, False, None)
    assert turn["context"] == "<|im_start|>assistant\n"

    assert agent["agent"] and agent["segments"] == 2 and [t["new_segment"] for t in agent["turns"]] == [False, True]
    assert agent["turns"][0]["messages"] == [{"role": "tool", "content": TOOL_RESULT, "tool_call_id": "call_1_0_0"}]
    assert (agent["advantage"], agent["stop_reason"]) == (-1.0, "done")

    assert failed["failed"] and failed["failure"] == FAILURE and failed["reward"] is None


def test_each_rollout_shows_its_lines_of_the_agents_log_from_its_last_run(tmp_path):
    store = hand_built_store(tmp_path)
    view = iteration_view(store)
    assert view["agents_log"] == str(tmp_path / "logs" / "agents-0.log")
    native, agent, failed = view["groups"][0]["rollouts"]
    assert (native["log"], native["log_lines"]) == ([], 0)
    assert (agent["log"], agent["log_lines"]) == (["hello", LOG_MARKUP], 2)
    assert failed["log_lines"] == LOG_LINES_SHOWN + 5 and len(failed["log"]) == LOG_LINES_SHOWN
    assert failed["log"][0] == "line 5" and failed["log"][-1] == f"line {LOG_LINES_SHOWN + 4}"  # the last ones

    (tmp_path / "logs" / "agents-0.log").unlink()  # a native run, or a log removed: nothing to show
    view = iteration_view(store)
    assert view["agents_log"] is None and all(not r["log"] for r in view["groups"][0]["rollouts"])


def test_the_page_carries_the_view_as_json_no_text_of_the_run_can_close_its_script_element(tmp_path):
    view = iteration_view(hand_built_store(tmp_path))
    html = page(view)
    for text in (MARKUP, TOOL_RESULT, FAILURE, LOG_MARKUP):
        assert text not in html
    before, after = PAGE.read_text().split(DATA_MARK)
    assert html.startswith(before) and html.endswith(after)
    assert json.loads(html[len(before) : len(html) - len(after)]) == {**view, "linked": False}


def test_an_iteration_not_stored_is_an_error_naming_the_ones_there(tmp_path):
    store = hand_built_store(tmp_path / "runs")
    with pytest.raises(StoreError, match="no iteration 3 .*; iterations: 0"):
        iteration_view(store, 3)
    with pytest.raises(StoreError, match="no iteration to view"):
        iteration_view(Store(tmp_path / "empty"))
