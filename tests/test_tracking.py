"""Experiment trackers (pipeline/monitoring/tracking.py): each tracker's own reader gets back what a real
`mtrl run` logged (TensorBoard's EventAccumulator, MlflowClient on an `mlflow server` this module
starts, W&B's offline run files read by W&B's own datastore reader, trackio's local store).

One tracked run serves every reader: 3 iterations with ppo.max_staleness=1 (the next batch made
beside each update), SIGKILLed once every tracker had logged iteration 0, resumed to its end, then
one more iteration as a deployment's flow run makes it (rl-iteration without arguments, in a process
of its own). Every tracker must hold one run with steps 0-3, each once, in order. A tracker at a
dead server leaves a run's data and exit code as they are without it. Slow: ~70 s."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.cli.main import main
from pipeline.monitoring.report import iterations
from pipeline.monitoring.tracking import TRAJECTORY_COLUMNS
from pipeline.store.versions import Store
from schemas.config import RunConfig

pytestmark = pytest.mark.slow

BACKENDS = ["tensorboard", "mlflow", "wandb", "trackio"]
ARGS = [
    "--rollouts",
    "8",
    "--group-size",
    "4",
    "--max-turns",
    "3",
    "--set",
    "generation.max_new_tokens=48",
    "--set",  # a cut turn scores below an answer: every iteration has something to train (and log)
    "reward.overlong_reward=-0.5",
]
STEPS = [0, 1, 2, 3]  # three iterations of `mtrl run`, then one of a deployment's run
DEPLOYMENT_RUN = """
import sys
from pipeline.orchestration.flows import rl_iteration
from schemas.config import RunConfig
rl_iteration(RunConfig.model_validate_json(sys.argv[1]))  # no iteration, no policy: the store's newest
"""


def mtrl_run(runs_dir: Path, env: dict, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--runs-dir", str(runs_dir), *ARGS, *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (SQLite store, one worker); yields its URL."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    url = f"http://127.0.0.1:{free_port()}"
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        url.rsplit(":", 1)[1],
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
    ]
    # Without its job runner (seven processes for MLflow's GenAI jobs: huey consumers, ~30 CPU-s while this module
    # runs on 2 cores): experiment tracking, what mtrl logs to, does not use it.
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "wb") as log:
        server = subprocess.Popen(
            command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            return True
        except OSError:
            return False

    try:
        # Wait for the server's own outcome: it answers, or it exits. (The bound only keeps a server that
        # does neither from hanging the suite; it is no claim on how fast it starts.)
        waited_until = time.monotonic() + 600
        while not answers() and server.poll() is None and time.monotonic() < waited_until:
            time.sleep(0.2)
        log_text = (folder / "server.log").read_text()
        assert server.poll() is None, f"mlflow server exited with {server.returncode} before it answered: {log_text}"
        assert answers(), f"mlflow server neither answered nor exited: {log_text}"
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def ledgers(runs_dir: Path) -> dict[str, dict]:
    folder = runs_dir / "tracking"
    return {
        name: json.loads((folder / f"{name}.json").read_text())
        for name in BACKENDS
        if (folder / f"{name}.json").is_file()
    }


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, prefect_server_env, mlflow_server):
    """The runs dir of the tracked run (module docstring), and the trackers' ledgers at the kill."""
    runs_dir = tmp_path_factory.mktemp("tracked")
    env = {**prefect_server_env, "WANDB_MODE": "offline"}
    tracking = ["--set", f"tracking.backends={json.dumps(BACKENDS)}", "--set", f"tracking.mlflow_uri={mlflow_server}"]
    run = [*tracking, "--iterations", "3", "--set", "ppo.max_staleness=1"]

    first = mtrl_run(runs_dir, env, *run)
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline:
        logged = ledgers(runs_dir)
        if len(logged) == len(BACKENDS) and all("0" in ledger["steps"] for ledger in logged.values()):
            break
        time.sleep(0.02)
    assert first.poll() is None, first.stdout.read().decode()  # killed while it runs
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    at_kill = ledgers(runs_dir)
    assert all("2" not in ledger["steps"] for ledger in at_kill.values())

    resumed = mtrl_run(runs_dir, env, *run)
    output = resumed.communicate(timeout=600)[0].decode()
    assert resumed.returncode == 0, output
    assert "tracker" not in output  # no tracker failed

    config = Store(runs_dir).versions("ppo-update")[-1].config
    deployment = [sys.executable, "-c", DEPLOYMENT_RUN, RunConfig.model_validate(config).model_dump_json()]
    done = subprocess.run(deployment, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "tracker" not in done.stdout + done.stderr, done.stdout + done.stderr
    return runs_dir, at_kill


@pytest.fixture(scope="module")
def report(tracked) -> dict[int, dict]:
    """mtrl report's rows of the tracked run, by iteration: what the trackers must show."""
    return {row["iteration"]: row for row in iterations(Store(tracked[0]))}


def test_every_tracker_continued_its_run_and_logged_each_iteration_once(tracked, report):
    runs_dir, at_kill = tracked
    assert sorted(report) == STEPS
    for name, ledger in ledgers(runs_dir).items():
        assert ledger["run_id"] == at_kill[name]["run_id"], name  # the same tracker run after the kill
        assert [int(step) for step in ledger["steps"]] == STEPS, name
        assert ledger["config_logged"]


def test_tensorboard_event_files_hold_each_step_once(tracked, report):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_folder,) = (tracked[0] / "tracking" / "tensorboard").iterdir()  # one run
    assert len(list(run_folder.glob("events.out.tfevents.*"))) == 3  # one per process that logged
    events = EventAccumulator(str(run_folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    rewards = events.Scalars("rollout/reward_mean")
    assert [event.step for event in rewards] == STEPS
    assert [event.value for event in rewards] == pytest.approx([report[i]["reward_mean"] for i in STEPS])
    losses = {event.step: event.value for event in events.Scalars("train/policy_loss")}
    expected = {i: report[i]["policy_loss"] for i in STEPS if "policy_loss" in report[i]}  # none without advantages
    assert losses == pytest.approx(expected, rel=1e-6) and len(expected) >= 2
    stage_seconds = [event.value for event in events.Scalars("time/stage_s")]
    assert stage_seconds == pytest.approx([report[i]["stage_seconds"] for i in STEPS], rel=1e-6)
    assert {"time/generate-rollouts_s", "time/ppo-update_s", "data/turns", "audit/ok"} <= set(events.Tags()["scalars"])
    tables = events.Tensors("trajectories/text_summary")
    assert [table.step for table in tables] == STEPS
    text = tables[0].tensor_proto.string_val[0].decode()
    assert text.startswith("| iteration | rollout_id | group_id | task | turns | text | reward | advantage |")
    assert len(text.splitlines()) == 2 + 4  # header, rule, tracking.trajectories rows


def test_mlflow_server_holds_one_run_with_each_step_once(tracked, report, mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("mtrl")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ledgers(tracked[0])["mlflow"]["run_id"]
    history = client.get_metric_history(run.info.run_id, "rollout/success_rate")
    assert [metric.step for metric in history] == STEPS
    assert [metric.value for metric in history] == pytest.approx([report[i]["success_rate"] for i in STEPS])
    assert run.data.params["task.rollouts"] == "8" and run.data.params["ppo.max_staleness"] == "1"
    assert run.data.params["versions/torch"].startswith("2.13.0")
    artifacts = [artifact.path for artifact in client.list_artifacts(run.info.run_id, "trajectories")]
    assert artifacts == [f"trajectories/iteration_{i:05d}.json" for i in STEPS]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, artifacts[0])).read_text())
    assert table["columns"][:2] == ["iteration", "rollout_id"] and len(table["data"]) == 4


def test_wandb_offline_run_files_hold_each_step_once(tracked, report):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    run_id = ledgers(tracked[0])["wandb"]["run_id"]
    files = sorted(glob.glob(str(tracked[0] / "tracking" / "wandb" / "offline-run-*" / "run-*.wandb")))
    # a folder per step: W&B's service writes a step for sure only when the run finishes (WandbTracker)
    assert len(files) == len(STEPS) and all(Path(file).name == f"run-{run_id}.wandb" for file in files)
    history, config = [], {}
    for file in sorted(files, key=os.path.getmtime):
        store = datastore.DataStore()
        store.open_for_scan(file)
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.append({**row, "folder": Path(file).parent})
            elif record.WhichOneof("record_type") == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    assert [row["_step"] for row in history] == STEPS
    assert [row["rollout/reward_mean"] for row in history] == pytest.approx([report[i]["reward_mean"] for i in STEPS])
    assert all(row["trajectories/_type"] == "table-file" and row["trajectories/nrows"] == 4 for row in history)
    table = json.loads((history[0]["folder"] / "files" / history[0]["trajectories/path"]).read_text())
    assert table["columns"] == TRAJECTORY_COLUMNS and [row[0] for row in table["data"]] == [0] * 4
    assert config["task.rollouts"] == 8 and config["versions/wandb"] == "0.29.0"


def test_trackio_store_holds_one_run_with_each_step_once(tracked, report):
    code = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_runs('mtrl'))); "
        "print(json.dumps([{k: v for k, v in log.items() if k in ('step', 'rollout/reward_mean')} "
        "for log in SQLiteStorage.get_logs('mtrl', sys.argv[1])]))"
    )
    # trackio reads TRACKIO_DIR when it is imported: a process of its own
    env = {**os.environ, "TRACKIO_DIR": str(tracked[0] / "tracking" / "trackio")}
    run_name = ledgers(tracked[0])["trackio"]["run_id"]
    read = subprocess.run([sys.executable, "-c", code, run_name], env=env, capture_output=True, text=True, check=True)
    runs, logs = read.stdout.splitlines()[-2:]
    assert json.loads(runs) == [run_name]
    logs = json.loads(logs)
    assert [log["step"] for log in logs] == STEPS
    assert [log["rollout/reward_mean"] for log in logs] == pytest.approx([report[i]["reward_mean"] for i in STEPS])


def test_a_tracker_at_a_dead_server_changes_neither_the_data_nor_the_exit_code(tmp_path, prefect_server_env, capsys):
    """MLflow at a server that accepts connections and never answers (the worst kind of dead: a
    refused connection fails at once): one warning, the iteration waits tracking.timeout_s once,
    TensorBoard beside it still logs every iteration."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel accepts connections into the backlog; nobody reads them
        dead = f"http://127.0.0.1:{silent.getsockname()[1]}"
        tracking = ["--set", 'tracking.backends=["mlflow","tensorboard"]', "--set", f"tracking.mlflow_uri={dead}"]
        runs = {}
        for name, extra in (("reference", []), ("dead", [*tracking, "--set", "tracking.timeout_s=2"])):
            process = mtrl_run(tmp_path / name, prefect_server_env, "--iterations", "2", *extra)
            runs[name] = (process.communicate(timeout=600)[0].decode(), process.returncode)
    (reference_output, reference_code), (output, code) = runs["reference"], runs["dead"]
    assert reference_code == 0, reference_output
    assert code == 0, output
    assert output.count("tracker mlflow failed") == 1 and "TimeoutError" in output
    assert "tracker tensorboard" not in output
    assert [int(step) for step in ledgers(tmp_path / "dead")["tensorboard"]["steps"]] == [0, 1]
    versions = [sorted(f"{m.stage}/{m.version}" for m in Store(tmp_path / name).versions()) for name in runs]
    assert versions[0] == versions[1]  # tracking is part of no version
    assert main(["diff", str(tmp_path / "reference"), str(tmp_path / "dead")]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")
    (run_log,) = (tmp_path / "dead" / "logs").glob("run-*.json")
    waited = json.loads(run_log.read_text())["phases"]["seconds"]["tracking"]
    # Waited for once: the one warning above (a tracker that failed is not called again, and each failure
    # warns). How long is a measurement, not a check: a loaded machine stretches it.
    print(f"tracking's share of the run with a dead MLflow server: {waited:.2f} s (tracking.timeout_s = 2)")
