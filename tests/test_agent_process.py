"""The agents' process (stages/generate_rollouts/agents/child.py, run.py): outcomes on a channel of its
own, what the agents print in the run's log by rollout, sync agents each in a thread of their own, and
`agent.python` (the agents in an environment of their own). Real processes, real HTTP on 127.0.0.1,
the embedded model behind the endpoint; the whole runs (`mtrl run` as a subprocess) are slow."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from agent_programs import forged_outcomes

from pipeline.cli.main import main
from pipeline.models.base_model import EMBEDDED_POLICY
from pipeline.monitoring.viewer import iteration_view
from pipeline.orchestration.stage_runs import settings_of
from pipeline.orchestration.stage_table import ROOT, stage_version
from pipeline.store.versions import Store
from schemas.config import RunConfig
from stages.generate_rollouts import agent_records
from stages.generate_rollouts.agents.run import CHILD, agents_log
from stages.generate_rollouts.engine import open_engine
from stages.policy.loading import load_tokenizer

OPENAI2_PYTHON = ROOT / ".venv-openai2" / "bin" / "python"  # `make setup` builds it: openai 2.x, nothing of mtrl


def config(runs_dir: Path, rollouts: int = 4, **agent) -> RunConfig:
    task = {"rollouts": rollouts, "group_size": 2}
    return RunConfig(task=task, agent=agent, store={"runs_dir": str(runs_dir)})


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer(EMBEDDED_POLICY)
    settings = settings_of("generate-rollouts", RunConfig())
    return open_engine(EMBEDDED_POLICY, tokenizer, settings.engine), tokenizer


def agents(engine, runs_dir: Path, function: str, rollouts: int = 4, **agent):
    """Iteration 0's agent rollouts of `function`: their records, and the lines of the agents' log."""
    settings = settings_of("generate-rollouts", config(runs_dir, rollouts, function=function, **agent))
    records = agent_records(*engine, settings, 0)
    return records, agents_log(runs_dir, 0).read_text().splitlines()


def test_what_an_agent_prints_logs_and_starts_is_in_the_log_by_rollout_and_changes_no_outcome(engine, tmp_path):
    records, log = agents(engine, tmp_path, "tests.agent_programs:noisy")
    assert {rollout_id: (record.failure, record.reward) for rollout_id, record in records.items()} == {
        rollout_id: (None, None)
        for rollout_id in range(4)  # None: the agent returned no reward, not 99
    }
    assert all(record.calls for record in records.values())
    assert log[0].startswith("=== agents of iteration 0: process ")
    for rollout_id in records:
        tag = f"[rollout {rollout_id}] "
        for line in (
            f"a plain line of rollout {rollout_id}",
            f"a line in two writes of rollout {rollout_id}",  # whole, though other rollouts wrote between
            *forged_outcomes(rollout_id),
            f"on stderr from rollout {rollout_id}",
            f"logged by rollout {rollout_id}",
        ):
            assert tag + line in log, (tag + line, log)
        # the inherited fd 1: untagged, as written (an unbuffered Python writes a line's end apart: another's may
        # come between)
        assert f"a subprocess of rollout {rollout_id}" in "\n".join(log)


def test_a_failed_rollouts_failure_names_its_log_where_its_traceback_is(engine, tmp_path):
    records, log = agents(engine, tmp_path, "tests.agent_programs:raises")
    failure = records[1].failure
    assert failure.startswith("the agent raised RuntimeError: the agent's own bug (agent_programs.py:")
    assert failure.endswith("; its output: logs/agents-0.log in the runs dir, the lines tagged [rollout 1]")
    assert "[rollout 1] RuntimeError: the agent's own bug" in log
    assert "[rollout 1] Traceback (most recent call last):" in log
    assert records[0].failure is None and not any(line.startswith("[rollout 0] Traceback") for line in log)


def test_an_agents_process_that_dies_fails_the_waiting_rollouts_with_its_exit_code_and_its_logs_end(engine, tmp_path):
    records, log = agents(engine, tmp_path, "tests.agent_programs:exits")
    assert "[rollout 1] rollout 1 ends the process" in log
    for record in records.values():
        assert record.failure.startswith(
            "the agents' process exited with code 3 before this rollout's agent returned; its log: "
            "logs/agents-0.log in the runs dir, ending with:\n"
        ), record.failure
        assert record.failure.endswith("[rollout 1] rollout 1 ends the process")


def test_a_resumed_iteration_appends_to_its_log(engine, tmp_path):
    for _ in range(2):
        records, log = agents(engine, tmp_path, "tests.agent_programs:says_hello")
    starts = [line for line in log if line.startswith("=== agents of iteration 0")]
    assert len(starts) == 2 and log.count("[rollout 3] hello from rollout 3") == 2


def test_sync_agents_each_run_in_a_thread_of_their_own_and_their_deadline_starts_with_them(engine, tmp_path):
    """40 sync agents whose tool takes 2 s, deadline 3.5 s, agent.concurrency 0 (all at once): each
    returns its reward. On a pool of fewer threads than rollouts (asyncio.to_thread's: cores + 4, at
    most 32) a second wave would start 2 s late and end past the deadline. The agent makes no model
    call, so how long the engine takes is no part of it."""
    records, log = agents(engine, tmp_path, "tests.agent_programs:sleepy_tool", rollouts=40, timeout_s=3.5)
    assert {rollout_id: (record.failure, record.reward) for rollout_id, record in records.items()} == {
        rollout_id: (None, 0.5) for rollout_id in range(40)
    }
    for rollout_id in range(40):  # printed in its thread: tagged with its rollout all the same
        assert f"[rollout {rollout_id}] the tool of rollout {rollout_id} returned" in log


def test_the_agents_process_needs_nothing_of_mtrls_environment():
    """child.py runs in the agent's own environment (agent.python): it imports the standard library only."""
    imported = set()
    for node in ast.walk(ast.parse(Path(CHILD).read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    optional = {"httpx", "openai"}  # imported when the agent's environment has them (the agent's client)
    assert imported - optional <= sys.stdlib_module_names, imported - optional - sys.stdlib_module_names


def test_where_the_agents_run_changes_no_version(tmp_path):
    def version(**agent) -> str:
        settings = settings_of(
            "generate-rollouts", config(tmp_path, function="examples.agents.openai_loop:agent", **agent)
        )
        return stage_version("generate-rollouts", settings, {}, {})

    base = version()
    assert version(python=str(OPENAI2_PYTHON), concurrency=3) == base
    assert version(timeout_s=7) != base  # a deadline decides which rollouts fail: it shapes the rows


def test_an_agent_python_that_is_not_there_is_a_clear_error(engine, tmp_path):
    with pytest.raises(ValueError, match=r"agent.python 'no/such/python' is no executable file"):
        agents(engine, tmp_path, "examples.agents.openai_loop:agent", python="no/such/python")


def mtrl_run(runs_dir: Path, env: dict, *args: str) -> None:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def failed_rollouts(runs_dir: Path) -> list[int]:
    store = Store(runs_dir)
    return [round(m.metrics["rollouts"] * m.metrics["failed_rate"]) for m in store.versions("assign-rewards")]


@pytest.mark.slow
def test_a_noisy_agent_trains_and_mtrl_view_shows_each_rollouts_lines(tmp_path, prefect_server_env):
    """The agent prints (plain lines, lines of valid JSON shaped like outcomes), writes to stderr, logs
    and starts a subprocess that prints: two iterations train with no rollout failed, and its lines are
    in each iteration's log under its rollout, as `mtrl view` shows them."""
    runs = tmp_path / "runs"
    args = ["--iterations", "2", "--rollouts", "4", "--group-size", "2", "--agent", "tests.agent_programs:noisy"]
    mtrl_run(runs, prefect_server_env, *args)
    assert failed_rollouts(runs) == [0, 0]
    for iteration in (0, 1):
        log = agents_log(runs, iteration).read_text().splitlines()
        for rollout_id in range(4):
            assert f"[rollout {rollout_id}] a plain line of rollout {rollout_id}" in log
            assert f"[rollout {rollout_id}] logged by rollout {rollout_id}" in log
            assert f"a subprocess of rollout {rollout_id}" in "\n".join(log)
        shown = {
            rollout["rollout_id"]: rollout["log"]
            for group in iteration_view(Store(runs), iteration)["groups"]
            for rollout in group["rollouts"]
        }
        assert sorted(shown) == [0, 1, 2, 3]
        for rollout_id, lines in shown.items():
            assert f"a plain line of rollout {rollout_id}" in lines and f"on stderr from rollout {rollout_id}" in lines
            assert not any(re.match(r"\[rollout \d+\]", line) for line in lines)  # the tag is taken off


@pytest.mark.slow
def test_an_agent_in_its_own_environment_gives_the_same_bytes_as_in_mtrls(
    tmp_path, prefect_server_env, openai_loop_run, capsys
):
    """examples/agents/openai_loop.py with openai 2.x in .venv-openai2 (agent.python) and with openai 3.x in
    mtrl's environment (openai_loop_run): the same versions, every byte the same (`mtrl diff`)."""
    if not OPENAI2_PYTHON.exists():
        pytest.fail(f"no {OPENAI2_PYTHON}: `make setup` builds it (make .venv-openai2/.installed)")
    version = subprocess.run([OPENAI2_PYTHON, "-c", "import openai; print(openai.__version__)"], capture_output=True)
    assert version.stdout.decode().startswith("2."), version
    mtrls, args = openai_loop_run
    mtrl_run(tmp_path / "own", prefect_server_env, *args, "--set", f"agent.python={OPENAI2_PYTHON}")
    for iteration in (0, 1):  # each iteration's agents ran in a process of the other environment's Python
        start = agents_log(tmp_path / "own", iteration).read_text().splitlines()[0]
        assert start.startswith(f"=== agents of iteration {iteration}: process ") and f" of {OPENAI2_PYTHON}, " in start
    assert failed_rollouts(tmp_path / "own") == failed_rollouts(mtrls) == [0, 0]
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "own"), str(mtrls)]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
