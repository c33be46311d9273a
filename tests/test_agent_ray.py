"""agent.runner ray: each shard of an iteration's rollouts has its agents run by a Ray task, in an
agents' process on the task's node, against the endpoint of the process that holds the model.

A real Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head and a second raylet
with an `agents` resource, both on 127.0.0.1), real `mtrl run`s as subprocesses (slow): the agents run
on the second node and give the bytes of the local agents' process; a Ray worker SIGKILLed mid-run
fails only the rollouts of its shard, the run goes on, and its agents' process is gone. Quick: the
process runner both paths share (runtime/piped_process.py), and where the agents run changes no version.

The agent programs here are imported by the agents' processes (agent.function tests.test_agent_ray:...):
this module imports nothing heavy at its top."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from examples.agents.openai_loop import agent as calculator

ROOT = Path(__file__).resolve().parents[1]  # the working directory of the runs
OPENAI2_PYTHON = ROOT / ".venv-openai2" / "bin" / "python"  # `make setup` builds it: openai 2.x, nothing of mtrl
ROLLOUTS = 8
HELD = range(4, 8)  # the rollouts of Ray task 2 of 2 (shards are contiguous): held_by_the_second_task holds them
# A file the test creates once it killed task 2's worker: the agents of task 1 wait for it. Its path comes
# in the environment the agents' node gives its Ray workers, and they their agents' processes.
RELEASE = "MTRL_TEST_AGENTS_RELEASE"


async def held_by_the_second_task(rollout) -> float | None:
    """Task 2's rollouts make one call, say so, and hold (until their Ray worker is killed); task 1's
    say they wait, wait for the test's file, then run the calculator's loop: they are still running
    when the other task's worker dies."""
    if rollout.rollout_id in HELD:
        await rollout.client.chat.completions.create(
            model=rollout.model, messages=rollout.messages, tools=rollout.tools
        )
        print("called; holding", flush=True)
        await asyncio.sleep(3600)
    print("waiting", flush=True)
    while not Path(os.environ[RELEASE]).exists():
        await asyncio.sleep(0.05)
    return await calculator(rollout)


# ---------------------------------------------------------------------------------------------- quick


def test_where_and_how_many_processes_run_the_agents_changes_no_version(tmp_path):
    from pipeline.orchestration.stage_runs import settings_of
    from pipeline.orchestration.stage_table import stage_version
    from schemas.config import RunConfig

    def version(**agent) -> str:
        config = RunConfig(
            task={"rollouts": 4, "group_size": 2},
            agent={"function": "examples.agents.openai_loop:agent", **agent},
            runner={"ray_address": "10.0.0.1:6379"},
            store={"runs_dir": str(tmp_path)},
        )
        return stage_version("generate-rollouts", settings_of("generate-rollouts", config), {}, {})

    on_ray = {"runner": "ray", "host": "0.0.0.0", "ray_resources": {"agents": 1}, "ray_tasks": 3}
    assert version(**on_ray) == version()
    assert version(max_calls=2) != version()  # a field that shapes the rows still counts


def test_agents_on_ray_need_a_cluster_and_amounts_of_resources():
    from schemas.config import RunConfig

    with pytest.raises(ValueError, match="agent.runner ray runs the agents on the nodes of a Ray cluster: set runner"):
        RunConfig(agent={"runner": "ray"})
    with pytest.raises(ValueError, match="amounts cannot be negative"):
        RunConfig(agent={"ray_resources": {"agents": -1}})
    assert RunConfig(agent={"runner": "ray"}, runner={"ray_address": "auto"}).agent.ray_resources == {"CPU": 1.0}


def test_a_piped_process_reports_apart_from_its_output_and_its_group_is_killed_when_its_reports_end(tmp_path):
    """What it prints is output, never a report; the sleeper it leaves behind (in its process group,
    holding its output open) is killed once its reports end, and the stream ends with its exit code."""
    from runtime.piped_process import EXITED, OUTPUT, REPORT, run_piped, start_piped

    sleeper = tmp_path / "sleeper.pid"
    program = (
        "import os, subprocess, sys\n"
        "request = sys.stdin.readline()\n"
        'print(\'{"a report": "printed"}\', flush=True)\n'
        f"print(subprocess.Popen(['sleep', '600']).pid, file=open({str(sleeper)!r}, 'w'))\n"
        "os.write(int(sys.argv[1]), ('got ' + request).encode())\n"
        "sys.exit(3)\n"
    )
    process = start_piped([sys.executable, "-c", program], dict(os.environ))
    events = [event for batch in run_piped(process, b"hello\n") for event in batch]
    assert [value for kind, value in events if kind == REPORT] == ["got hello\n"]
    assert [value for kind, value in events if kind == OUTPUT] == [b'{"a report": "printed"}\n']
    assert events[-1] == (EXITED, 3)
    # SIGKILL is delivered when the kernel next schedules the sleeper: on a loaded machine its pipe can
    # close a moment before /proc shows it dead, so wait for that (a sleeper never killed stays 600 s).
    sleeper_pid, deadline = int(sleeper.read_text()), time.monotonic() + 30
    while running(sleeper_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(sleeper_pid)


# ----------------------------------------------------------------------------------------------- slow


def running(pid: int) -> bool:
    """Is this process alive (a zombie, dead but not yet reaped, is not)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def agent_nodes():
    """A Ray cluster of two nodes on this machine, both on 127.0.0.1: the head (1 CPU) and an agents'
    node with the resource {"agents": 4}, whose processes have RELEASE in their environment. Yields its
    address, the agents' node's id, its raylet's pid and the path RELEASE names."""
    from runtime.ray import import_ray

    ray = import_ray("the test cluster")  # first: Ray reads RAY_ENVIRONMENT when it is imported
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="mtrl-ray-", dir="/tmp")  # Ray's socket paths must stay short
    # the cluster writes its address to Ray's default folder (/tmp/ray), which it does not create
    Path(ray._private.utils.get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "temp_dir": temp_dir,
        },
    )
    release = Path(temp_dir) / "released"
    try:
        os.environ[RELEASE] = str(release)  # the raylet started now inherits it, and gives it on
        try:
            agents = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"agents": 4})
        finally:
            del os.environ[RELEASE]
        raylet = agents.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        yield cluster.address, agents.node_id, raylet, release
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def on_ray(address: str, tasks: int) -> list[str]:
    """`tasks` Ray tasks, each asking for one unit of `agents`: all on the agents' node."""
    settings = {
        "agent.runner": "ray",
        "runner.ray_address": address,
        "agent.ray_tasks": tasks,
        "agent.ray_resources": json.dumps({"agents": 1}),
    }
    return [argument for name, value in settings.items() for argument in ("--set", f"{name}={value}")]


def mtrl_run(runs_dir: Path, env: dict, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *args]
    log = (runs_dir.parent / f"{runs_dir.name}.out").open("w")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finished(run: subprocess.Popen, runs_dir: Path) -> None:
    code = run.wait(timeout=900)
    assert code == 0, (runs_dir.parent / f"{runs_dir.name}.out").read_text()[-6000:]


TASK_LINE = re.compile(
    r"--- Ray task (\d) of \d, rollouts (\d+)-(\d+): process (\d+) of (.*), Ray worker (\d+) on node (\w+) \(127\.0\.0\.1\) ---"
)


def ray_tasks(log: str) -> dict[int, dict[str, object]]:
    """The Ray tasks the agents' log names: task number -> rollouts, process pid and program, worker pid,
    node id."""
    return {
        int(task): {
            "rollouts": range(int(first), int(last) + 1),
            "pid": int(pid),
            "program": program,
            "worker": int(worker),
            "node": node,
        }
        for task, first, last, pid, program, worker, node in TASK_LINE.findall(log)
    }


@pytest.mark.slow
def test_agents_on_another_ray_node_give_the_bytes_of_the_local_agents(
    tmp_path, prefect_server_env, agent_nodes, openai_loop_run, capsys
):
    """Two Ray tasks on the agents' node, in the agent's own environment: their calls reach the endpoint
    at other moments than the local process's (openai_loop_run), in other batches, and the hf engine's
    numbers do not depend on a row's batch: the same bytes."""
    from pipeline.cli.main import main
    from stages.generate_rollouts.agents.run import agents_log

    address, agents_node, _, _ = agent_nodes
    local, agent = openai_loop_run
    # on Ray, in the agent's own environment (openai 2.x; tests/test_agent_process.py: the same bytes as in
    # mtrl's), named relative to the working directory and found on the node
    python = ["--set", f"agent.python={OPENAI2_PYTHON.relative_to(ROOT)}"]
    finished(mtrl_run(tmp_path / "ray", prefect_server_env, *agent, *on_ray(address, 2), *python), tmp_path / "ray")
    for iteration in (0, 1):
        tasks = ray_tasks(agents_log(tmp_path / "ray", iteration).read_text())
        assert [task["rollouts"] for _, task in sorted(tasks.items())] == [range(0, 4), range(4, 8)]
        assert all((task["node"], task["program"]) == (agents_node, str(OPENAI2_PYTHON)) for task in tasks.values())
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "ray"), str(local)]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")


@pytest.mark.slow
def test_a_killed_ray_worker_fails_only_its_shards_rollouts_and_leaves_no_agents_process(
    tmp_path, prefect_server_env, agent_nodes
):
    """Task 2's agents hold after their first call and task 1's wait: task 2's Ray worker, SIGKILLed
    then, takes its agents' process along; rollouts 4-7 fail saying so, 0-3 go on once released, and
    the run ends well."""
    from pipeline.store.versions import Store
    from stages.generate_rollouts.agents.run import agents_log

    address, agents_node, raylet, release = agent_nodes
    runs = tmp_path / "runs"
    agent = ["--iterations", "1", "--rollouts", str(ROLLOUTS), "--group-size", "4"]
    agent += ["--agent", "tests.test_agent_ray:held_by_the_second_task"]
    run = mtrl_run(runs, prefect_server_env, *agent, *on_ray(address, 2), "--set", "agent.timeout_s=120")
    tasks: dict[int, dict[str, object]] = {}
    try:
        deadline = time.monotonic() + 600
        held = [f"[rollout {rollout_id}] called; holding" for rollout_id in HELD]
        held += [f"[rollout {rollout_id}] waiting" for rollout_id in range(ROLLOUTS) if rollout_id not in HELD]
        while time.monotonic() < deadline and run.poll() is None:
            log = agents_log(runs, 0).read_text() if agents_log(runs, 0).exists() else ""
            tasks = ray_tasks(log)
            if len(tasks) == 2 and all(line in log.splitlines() for line in held):
                break
            time.sleep(0.2)
        assert len(tasks) == 2 and run.poll() is None, (runs.parent / "runs.out").read_text()[-6000:]
        assert [task["rollouts"] for _, task in sorted(tasks.items())] == [range(0, 4), HELD]
        assert {task["node"] for task in tasks.values()} == {agents_node}  # never the head's
        second = tasks[2]
        # the agents' process is a child of the Ray worker, and the worker one of the agents' node's raylet
        assert parent(second["pid"]) == second["worker"] and parent(second["worker"]) == raylet
        os.kill(second["worker"], signal.SIGKILL)
        release.touch()
        finished(run, runs)
    finally:
        if run.poll() is None:
            run.kill()
    assert not running(second["pid"]) and not running(tasks[1]["pid"])

    rows = Store(runs).load("assign-rewards", Store(runs).versions("assign-rewards")[-1].version).to_list()
    failures = {row["rollout_id"]: row["failure"] for row in rows if row["stop_reason"] is not None}
    assert sorted(failures) == list(range(ROLLOUTS))  # every rollout ended
    for rollout_id in HELD:
        assert failures[rollout_id].startswith("the Ray task 2 of 2 that ran this rollout's agent, node "), failures
        assert "was lost" in failures[rollout_id] and "before the agent returned" in failures[rollout_id]
    assert all(failures[rollout_id] is None for rollout_id in range(ROLLOUTS) if rollout_id not in HELD), failures


@pytest.mark.slow
def test_a_node_without_the_agents_python_fails_the_stage_saying_so(tmp_path, agent_nodes):
    """agent.python is found on the node: one it does not have is a setting error, not failed rollouts."""
    from pipeline.models.base_model import EMBEDDED_POLICY
    from pipeline.orchestration.stage_runs import settings_of
    from schemas.config import RunConfig
    from stages.generate_rollouts import agent_records
    from stages.generate_rollouts.engine import open_engine
    from stages.policy.loading import load_tokenizer

    config = RunConfig(
        task={"rollouts": 2, "group_size": 2},
        agent={"function": "examples.agents.openai_loop:agent", "runner": "ray", "python": "no/such/python"},
        runner={"ray_address": agent_nodes[0]},
        store={"runs_dir": str(tmp_path)},
    )
    settings = settings_of("generate-rollouts", config)
    tokenizer = load_tokenizer(EMBEDDED_POLICY)
    engine = open_engine(EMBEDDED_POLICY, tokenizer, settings.engine)
    failure = r"agent.runner ray, Ray task 1 of 1: no/such/python is no executable file on the node at 127\.0\.0\.1"
    with pytest.raises(ValueError, match=failure):
        agent_records(engine, tokenizer, settings, 0)
