"""Orchestration with real Prefect: re-running one stage, a real server with `mtrl serve` and
triggered runs, and `prefect deploy --all` of deployments/prefect.yaml (slow)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store.versions import Store

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--rollouts", "4", "--group-size", "2", "--max-turns", "2", "--set", "generation.max_new_tokens=48"]


@pytest.mark.slow  # two estimators over a played iteration (about 11 s)
@pytest.mark.usefixtures("prefect_server")
def test_mtrl_stage_ab_tests_two_estimators_on_identical_rollouts(tmp_path, capsys):
    from pipeline.cli.main import main

    runs = str(tmp_path / "runs")
    run = ["--iterations", "1", "--rollouts", "16", "--group-size", "4", "--max-turns", "3"]
    assert main(["run", "--runs-dir", runs, *run]) == 0
    store = Store(runs)
    (rewards,) = store.versions("assign-rewards")
    (grpo,) = store.versions("compute-advantages")
    capsys.readouterr()
    source = f"assign-rewards/{rewards.version}"
    assert main(["stage", "compute-advantages", "--from", source, "--runs-dir", runs, "--advantage", "rloo"]) == 0
    rloo_version = capsys.readouterr().out.split()[0].split("/")[1]
    rloo = store.manifest("compute-advantages", rloo_version)
    assert rloo_version != grpo.version and rloo.config["advantage"]["estimator"] == "rloo"
    assert rloo.parents == grpo.parents and grpo.parents["assign-rewards"] == rewards.version
    # the recorded config of the lineage is reused: asking for grpo again is the stored version
    assert main(["stage", "compute-advantages", "--from", source, "--runs-dir", runs]) == 0
    assert capsys.readouterr().out.split()[0] == f"compute-advantages/{grpo.version}"
    a, b = store.load("compute-advantages", grpo.version), store.load("compute-advantages", rloo_version)
    assert a["completion_token_ids"] == b["completion_token_ids"]
    assert any(v != 0 for row in a["advantages"] for v in row) and a["advantages"] != b["advantages"]
    assert main(["stage", "ppo-update", "--from", f"assign-rewards/{rewards.version}", "--runs-dir", runs]) == 2


def prefect(env: dict, *args: str, cwd: Path = ROOT, timeout: float = 300) -> str:
    """Prefect's CLI; its output is printed by rich, which wraps at 80 columns without a terminal
    (a long path would be split): a wide one."""
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        env={**env, "COLUMNS": "1000"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_serve_then_two_triggered_runs_chain_iterations_and_overlap(prefect_server_env, tmp_path):
    """Two runs of `mtrl serve`'s deployment with ppo.max_staleness=1: each trains the newest policy,
    and the first makes the second's batch beside its ppo-update (the second finds it stored)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    runs, log = tmp_path / "runs", tmp_path / "serve.log"
    serving = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "serve",
            "--runs-dir",
            str(runs),
            *SMALL,
            "--set",
            "ppo.max_staleness=1",
        ],
        env=prefect_server_env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while (
            "rl-iteration/local" not in prefect(prefect_server_env, "deployment", "ls") and time.monotonic() < deadline
        ):
            time.sleep(1)
        for _ in range(2):
            prefect(
                prefect_server_env,
                "deployment",
                "run",
                "rl-iteration/local",
                "--watch",
                "--watch-interval",
                "1",
                "--watch-timeout",
                "240",
            )
    except AssertionError:
        print(log.read_text()[-6000:])  # the served runs' own logs
        raise
    finally:
        serving.terminate()
        serving.wait(timeout=30)
    store = Store(runs)
    policies = sorted(store.versions("policy"), key=lambda m: m.iteration)
    assert [m.iteration for m in policies] == [-1, 0, 1]
    second_update = store.manifest("ppo-update", policies[2].parents["ppo-update"])
    assert second_update.parents["policy"] == policies[1].version  # iteration 1 trained iteration 0's policy
    with temporary_settings({PREFECT_API_URL: prefect_server_env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            flow_runs = [  # of the newest 200: the server is shared
                run
                for run in client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC)
                if run.parameters.get("config", {}).get("store", {}).get("runs_dir") == str(runs)
            ]
            first = min(flow_runs, key=lambda run: run.start_time)
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.id])))
    (update,) = [run for run in task_runs if run.name.startswith("ppo-update")]
    batch_made = min(run.end_time for run in task_runs if run.name.startswith("compute-advantages"))
    ahead = [run for run in task_runs if run.name.startswith("generate-rollouts") and run.start_time >= batch_made]
    assert ahead and min(run.start_time for run in ahead) < update.end_time  # iteration 1's turns, beside the update
    assert len(ahead) == len([m for m in store.versions("generate-rollouts") if m.iteration == 1])


@pytest.mark.slow
def test_prefect_deploy_all_registers_the_scheduled_deployment(prefect_server_env, tmp_path):
    env = {**prefect_server_env, "MTRL_RUNS_DIR": str(tmp_path / "scheduled")}
    prefect(env, "work-pool", "create", "mtrl-process", "--type", "process")
    prefect(env, "--no-prompt", "deploy", "--all", cwd=ROOT / "deployments")
    shown = prefect(env, "deployment", "inspect", "rl-iteration/hourly")
    assert "3600" in shown and str(tmp_path / "scheduled") in shown and "mtrl-process" in shown
    assert "pipeline.orchestration.flows.rl_iteration" in shown
