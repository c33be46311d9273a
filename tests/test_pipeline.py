"""Real Prefect flow runs over a real store: versions, caching, partial re-runs, data checks."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.orchestration.stage_table import POLICY, STAGES
from pipeline.store.versions import Store
from schemas.token_stream import generation_prompt_ids, observation_token_ids, prompt_token_ids, rollouts
from stages.environments import ENVIRONMENTS
from stages.tools import TOOLS, tool_schema

pytestmark = pytest.mark.usefixtures("prefect_server")


def folders(store: Store) -> set[str]:
    return {f"{m.stage}/{m.version}" for m in store.versions()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=1,
        task={"rollouts": 8, "group_size": 4, "max_turns": 3},
        generation={"max_new_tokens": 64},
        ppo={"minibatch_rollouts": 4},
        store={"runs_dir": tmp_path_factory.mktemp("runs")},
    )
    results = rl_training(config)
    return config, results, Store(config.store.runs_dir)


def test_every_stage_writes_a_versioned_dataset_with_a_manifest(first_run):
    config, results, store = first_run
    (result,) = results
    assert {m.stage for m in store.versions()} == {*STAGES, POLICY} - {"sft"}  # sft.steps 0: no warm start
    for manifest in store.versions():
        assert {"stage", "version", "parents", "config", "created_at", "files"} <= set(manifest.model_dump())
        assert store.verify(manifest.stage, manifest.version) == []
        if manifest.stage != POLICY:
            assert manifest.rows is not None and manifest.wall_s is not None
            loaded = datasets.load_from_disk(str(store.path(manifest.stage, manifest.version)))
            assert len(loaded) == manifest.rows
    rewarded = store.load("assign-rewards", result["versions"]["assign-rewards"])
    assert set(rewarded["rollout_id"]) == set(range(8)) and len(rewarded) >= 8
    # no KL term by default: compute-advantages reads no reference policy
    assert store.manifest("compute-advantages", result["versions"]["compute-advantages"]).parents == {
        "assign-rewards": result["versions"]["assign-rewards"],
    }
    trained = AutoModelForCausalLM.from_pretrained(store.policy_dir(result["next_policy"]))
    assert trained.config.model_type == "qwen3"
    # the memory settings left null were chosen by the model's size (small: no saving) and recorded
    assert store.manifest("ppo-update", result["versions"]["ppo-update"]).extra("memory_settings") == {
        "parameters": trained.num_parameters(),
        "gradient_checkpointing": False,
        "max_tokens_per_micro_batch": 0,
    }


def test_the_flow_run_shows_the_plot_a_table_and_finished_progress_bars(first_run):
    """Read back through Prefect's API: the summary embeds the plot as a PNG data URL above a
    markdown table, and generation and ppo-update each left a progress artifact at 100 %."""
    import base64
    import re

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    _, _, store = first_run
    with get_client(sync_client=True) as client:
        summaries = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rl-iteration-summary"])),
            sort=ArtifactSort.CREATED_DESC,
        )
        # the first run on this store: later tests run it again, cached stages publish no progress
        summary = [a for a in summaries if str(store.root) in a.data][-1]
        progress = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[summary.flow_run_id]))
        )
        # the stage tables of the iteration's flow run: a table sent on another run is missing below
        tables = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=list(STAGES)),
                flow_run_id=ArtifactFilterFlowRunId(any_=[summary.flow_run_id]),
            )
        )
    image = re.search(r"!\[[^]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", summary.data)
    assert image and base64.b64decode(image.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    assert len(image.group(1)) < 100_000  # embedded in every iteration's summary: kept small
    assert "\n| iter | success | reward |" in summary.data and "\n|---:|" in summary.data
    assert re.search(r"\n\| 0 \| [0-9.]+ \|", summary.data)  # iteration 0's row
    bars = {a.key: a.data for a in progress if a.type == "progress"}
    assert bars == {"generate-rollouts-progress": 100.0, "ppo-update-progress": 100.0}
    # every stage version's table, sent in the background, reached its own task run
    published = {a.description.split(" in ")[0]: a for a in tables if a.description.endswith(f" in {store.root}")}
    written = {f"{m.stage}/{m.version}" for m in store.versions() if m.stage != POLICY}
    assert set(published) == written
    assert all(a.task_run_id is not None for a in published.values())


def test_token_streams_reproduce_what_the_model_saw(first_run, tiny):
    """Concatenating context + completion + observation per turn gives the model's context:
    turn 0 starts with the rendered prompt, later turns with the template's deltas, and the
    stored logprobs equal a fresh fp32 forward pass of the stored policy over that stream."""
    config, (result,), store = first_run
    _, tokenizer = tiny
    model = AutoModelForCausalLM.from_pretrained(store.policy_dir(result["policy"]), dtype=torch.float32)
    rows = sorted(
        store.load("compute-advantages", result["versions"]["compute-advantages"]),
        key=lambda r: (r["rollout_id"], r["turn"]),
    )
    tools = [tool_schema(TOOLS[name]) for name in ENVIRONMENTS["calculator"].tools]
    streams: dict[int, list[int]] = {}
    scored: dict[int, list[tuple[int, float]]] = {}
    for row in rows:
        stream = streams.setdefault(row["rollout_id"], [])
        if row["turn"] == 0:
            task = json.loads(row["task_payload"])
            assert row["context_token_ids"] == prompt_token_ids(
                tokenizer, ENVIRONMENTS["calculator"].reset(task), tools, config.generation.enable_thinking
            )
        else:
            assert row["context_token_ids"] == generation_prompt_ids(tokenizer, config.generation.enable_thinking)
        assert row["stream_offset"] == len(stream)
        stream += row["context_token_ids"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) == len(row["advantages"])
        scored.setdefault(row["rollout_id"], []).extend(
            (len(stream) + i, lp) for i, lp in enumerate(row["completion_logprobs"])
        )
        stream += row["completion_token_ids"]
        if row["observation_token_ids"]:
            results = [{"role": "tool", "content": call["result"]} for call in row["tool_calls"]]
            assert row["observation_token_ids"] == observation_token_ids(tokenizer, results)
        stream += row["observation_token_ids"]
    worst = 0.0
    with torch.no_grad():
        for rollout_id, stream in streams.items():
            logprobs = torch.log_softmax(model(torch.tensor([stream])).logits[0].float(), -1)
            for position, stored in scored[rollout_id]:
                worst = max(worst, abs(logprobs[position - 1, stream[position]].item() - stored))
    print(f"stored vs fresh logprob max abs difference: {worst:.3g}")
    assert worst < 1e-4


def test_same_command_again_is_all_cache_hits(first_run):
    from pipeline.orchestration.flows import rl_training

    config, (result,), store = first_run
    before = folders(store)
    (again,) = rl_training(config)
    assert again["versions"] == result["versions"] and again["next_policy"] == result["next_policy"]
    assert folders(store) == before


def test_changing_only_the_estimator_reuses_the_rollouts(first_run):
    from pipeline.orchestration.flows import rl_training

    config, (result,), store = first_run
    before = folders(store)
    (rloo,) = rl_training(config.with_overrides({"advantage.estimator": "rloo"}))
    for stage in ("execute-tools", "assign-rewards"):
        assert rloo["versions"][stage] == result["versions"][stage]
    for stage in ("compute-advantages", "ppo-update"):
        assert rloo["versions"][stage] != result["versions"][stage]
    assert rloo["next_policy"] != result["next_policy"]
    assert folders(store) - before == {
        f"compute-advantages/{rloo['versions']['compute-advantages']}",
        f"ppo-update/{rloo['versions']['ppo-update']}",
        f"policy/{rloo['next_policy']}",
    }
    assert before <= folders(store)  # nothing overwritten or removed


def test_a_deleted_version_is_recomputed_not_served_from_prefects_cache(first_run):
    import shutil

    from pipeline.orchestration.flows import rl_training

    config, (result,), store = first_run
    version = result["versions"]["compute-advantages"]
    shutil.rmtree(store.path("compute-advantages", version))
    (again,) = rl_training(config)
    assert again["versions"]["compute-advantages"] == version
    assert store.exists("compute-advantages", version) and store.verify("compute-advantages", version) == []


def test_a_deleted_policy_folder_is_named_with_its_rebuild_command_and_rebuilt_with_the_same_bytes(first_run):
    import shutil

    from pipeline.cli.main import error_message
    from pipeline.orchestration.flows import rl_training
    from schemas.manifest import MissingVersionError

    config, (result,), store = first_run
    policy = result["next_policy"]
    files = store.manifest(POLICY, policy).files
    shutil.rmtree(store.path(POLICY, policy))
    advantaged = result["versions"]["compute-advantages"]
    with pytest.raises(MissingVersionError) as missing:
        store.policy_dir(policy)
    assert error_message(missing.value).endswith(
        f"wrote it: `mtrl stage ppo-update --from compute-advantages/{advantaged}` rebuilds it"
    )
    (again,) = rl_training(config)  # its ppo-update version exists: the update runs again for the policy
    assert again["next_policy"] == policy and again["versions"] == result["versions"]
    assert store.manifest(POLICY, policy).files == files  # the same bytes as the deleted policy
    assert store.policy_dir(policy) == store.path(POLICY, policy)


def test_a_runs_dir_moved_away_from_its_starting_model_keeps_its_lineage(tmp_path):
    """The starting policy is stored in the runs dir (linked or copied), not pointed at: move the
    runs dir and the model folder elsewhere, and the run goes on from its cache."""
    import shutil

    from pipeline.models.base_model import EMBEDDED_POLICY
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    shutil.copytree(EMBEDDED_POLICY, tmp_path / "model")
    small = {
        "task": {"rollouts": 4, "group_size": 2, "max_turns": 2},
        "generation": {"max_new_tokens": 32},
        "ppo": {"minibatch_rollouts": 4},
    }
    config = RunConfig(
        iterations=1, model={"path": str(tmp_path / "model")}, store={"runs_dir": tmp_path / "a"}, **small
    )
    (first,) = rl_training(config)
    (tmp_path / "a").rename(tmp_path / "b")
    (tmp_path / "model").rename(tmp_path / "model-moved")
    moved = config.with_overrides(
        {"iterations": 2, "model.path": str(tmp_path / "model-moved"), "store.runs_dir": str(tmp_path / "b")}
    )
    again, second = rl_training(moved)
    assert again == first  # iteration 0: every version served from the moved store
    store = Store(tmp_path / "b")
    assert store.policy_dir(first["policy"]) == store.path(POLICY, first["policy"])
    assert store.manifest("ppo-update", second["versions"]["ppo-update"]).extra("audit")["ok"]


def test_gae_with_kl_in_the_reward_and_lora_over_two_iterations(tmp_path):
    """The critic and the reference are read by compute-advantages, the value head travels with
    the policy, and a LoRA update is merged into a plain checkpoint."""
    from pipeline.monitoring.report import write_report
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=2,
        task={"rollouts": 4, "group_size": 2, "max_turns": 2},
        generation={"max_new_tokens": 48},
        # a cut turn scores below an answer: the tiny model's groups differ, so there is something to train
        reward={"overlong_reward": -0.5},
        advantage={"estimator": "gae"},
        ppo={"minibatch_rollouts": 4, "kl_coef": 0.05, "kl_in": "reward", "lora_rank": 4},
        store={"runs_dir": tmp_path / "runs"},
    )
    first, second = rl_training(config)
    store = Store(config.store.runs_dir)
    for result in (first, second):
        manifest = store.manifest("compute-advantages", result["versions"]["compute-advantages"])
        assert manifest.parents["policy"] == result["policy"]
        assert manifest.parents["policy#reference"] == first["policy"]  # the iteration-0 policy
        data = store.load("compute-advantages", result["versions"]["compute-advantages"])
        assert all(len(v) == len(c) for v, c in zip(data["values"], data["completion_token_ids"]))
        assert all(len(r) == len(c) for r, c in zip(data["ref_logprobs"], data["completion_token_ids"]))
    trained = store.policy_dir(first["next_policy"])
    assert (trained / "value_head.safetensors").is_file() and not (trained / "adapter_config.json").exists()
    # iteration 1 scores with the trained critic: its values are no longer all zero
    values = store.load("compute-advantages", second["versions"]["compute-advantages"])["values"]
    assert any(v != 0.0 for row in values for v in row)
    metrics = store.load("ppo-update", second["versions"]["ppo-update"])
    assert all(v is not None for v in metrics["value_loss"])
    # Every pass is counted where it runs: iteration 0's reference logprobs are the generation ones
    # (no pass), iteration 1 scores the reference; the group's shared prompt is computed once.
    first_passes, second_passes = (
        store.manifest("compute-advantages", result["versions"]["compute-advantages"]).extra("passes")
        for result in (first, second)
    )
    data = store.load("compute-advantages", second["versions"]["compute-advantages"])
    streams = sum(len(rollout.token_ids) for rollout in rollouts(data))
    targets = sum(len(c) for c in data["completion_token_ids"])
    assert set(first_passes) == {"values"} and set(second_passes) == {"values", "reference"}
    for counts in second_passes.values():
        assert (
            counts["targets"] == targets and counts["tokens"] < streams and counts["tokens"] <= counts["padded_tokens"]
        )
    update = store.manifest("ppo-update", second["versions"]["ppo-update"])
    # the hf engine in float32: no old-logprob pass; no activation checkpointing at this size
    assert set(update.extra("passes")) == {"training_forward", "training_backward"}
    assert update.extra("passes")["training_forward"]["targets"] == targets
    assert update.extra("audit")["passes"]["audit_rescore"]["passes"] >= 1
    curve, png = write_report(store)
    assert png.is_file() and len(curve.splitlines()) == 3


def test_a_new_stage_is_one_module_and_one_registration_line(first_run, monkeypatch):
    """tests/plugin_stage.py declares a stage as docs/extending.md shows; registered in the stage
    table (one line), `mtrl stage` re-runs it on a stored input: its task, version, manifest and
    re-run entry all come from the declaration."""
    import plugin_stage

    from pipeline.cli.main import RerunnableStages
    from pipeline.orchestration import stage_table
    from pipeline.orchestration.flows import rerun_stage

    monkeypatch.setitem(stage_table.STAGES, plugin_stage.STAGE.name, plugin_stage.STAGE)  # the registration line
    assert "token-budget" in RerunnableStages() and stage_table.rerun_map()["token-budget"] == "assign-rewards"
    config, (result,), store = first_run
    source = f"assign-rewards/{result['versions']['assign-rewards']}"
    version = rerun_stage(config, "token-budget", source)
    manifest = store.manifest("token-budget", version)
    assert manifest.parents == {"assign-rewards": result["versions"]["assign-rewards"]}
    assert manifest.settings == {"max_new_tokens": 64} and manifest.metrics["budget_used_max"] <= 1.0
    rows = store.load("token-budget", version)
    rewarded = store.load("assign-rewards", result["versions"]["assign-rewards"])
    assert rows["budget_used"] == pytest.approx([len(ids) / 64 for ids in rewarded["completion_token_ids"]])
    assert stage_table.code_files("token-budget")[-1].name == "plugin_stage.py"  # its module is its code
    assert rerun_stage(config, "token-budget", source) == version  # stored: found, not computed again
    wider = config.with_overrides({"generation.max_new_tokens": 80})
    assert rerun_stage(wider, "token-budget", source) != version  # its setting is in its version


def test_a_second_engine_plugs_in_by_name_without_touching_the_flow(first_run, tmp_path):
    """An engine registered in ENGINES is selected by generation.engine: here the HF engine
    re-encoding every turn (no KV reuse) gives the flow the same sampled tokens."""
    from pipeline.orchestration.flows import rl_training
    from stages.generate_rollouts.engine import ENGINES
    from stages.generate_rollouts.hf import HFEngine

    class ReEncodingEngine(HFEngine):
        def sample(self, requests, sampling, forced=None, report_progress=None):
            self.reset()
            return super().sample(requests, sampling, forced, report_progress)

    ENGINES["hf-re-encode"] = ReEncodingEngine.open
    try:
        config, (result,), store = first_run
        other = config.with_overrides({"generation.engine": "hf-re-encode", "store.runs_dir": str(tmp_path)})
        (again,) = rl_training(other)
    finally:
        del ENGINES["hf-re-encode"]
    first = store.load("assign-rewards", result["versions"]["assign-rewards"])
    second = Store(tmp_path).load("assign-rewards", again["versions"]["assign-rewards"])
    assert again["versions"]["assign-rewards"] != result["versions"]["assign-rewards"]  # the engine is hashed
    assert first["completion_token_ids"] == second["completion_token_ids"] and first["reward"] == second["reward"]


def test_an_iteration_where_every_rollout_fails_stops_and_writes_no_policy(tmp_path, monkeypatch):
    """A run whose environment is down must not look like success: the audit in front of
    ppo-update stops the iteration (audit.max_failed_fraction) and no new policy is written."""
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig
    from stages.environments import CalculatorEnv

    class EnvironmentDown(CalculatorEnv):
        name = "environment-down"

        def step(self, *args, **kwargs):
            raise RuntimeError("the environment's server is down")

    monkeypatch.setitem(ENVIRONMENTS, EnvironmentDown.name, EnvironmentDown())
    config = RunConfig(
        iterations=1,
        task={"name": EnvironmentDown.name, "rollouts": 4, "group_size": 2, "max_turns": 2},
        store={"runs_dir": tmp_path},
    )
    with pytest.raises(Exception, match=r"4 of 4 rollouts failed .*the environment's server is down"):
        rl_training(config)
    assert [m.iteration for m in Store(tmp_path).versions("policy")] == [-1]  # only the starting policy


def test_an_iteration_whose_prompts_all_overflow_the_context_stops_and_writes_no_policy(tmp_path):
    """Every prompt longer than generation.max_context_tokens: each rollout ends as a context
    overflow before generating, and an update on no tokens must not pass for a trained policy."""
    from pipeline.orchestration.flows import rl_training
    from schemas.config import RunConfig

    config = RunConfig(
        iterations=1,
        task={"rollouts": 4, "group_size": 2},
        generation={"max_context_tokens": 64, "max_new_tokens": 32},  # the calculator prompts are longer
        store={"runs_dir": tmp_path},
    )
    with pytest.raises(Exception, match=r"not one completion token in 4 rollouts.*context_overflow 4"):
        rl_training(config)
    assert [m.iteration for m in Store(tmp_path).versions("policy")] == [-1]  # only the starting policy


@pytest.mark.parametrize("flow_name", ["rl_iteration", "rl_training", "warm_start"])
def test_a_flow_started_without_mtrl_runs_the_preflight_checks_before_any_work(tmp_path, flow_name):
    """A deployment's run starts in the flow, not in `mtrl`: a config naming an estimator no
    registry has fails there at once, before the starting model is imported or anything runs."""
    from pipeline.orchestration import flows
    from pipeline.orchestration.preflight import ConfigError
    from schemas.config import RunConfig

    config = RunConfig(advantage={"estimator": "nonesuch"}, sft={"steps": 1}, store={"runs_dir": tmp_path})
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nonesuch'"):
        getattr(flows, flow_name)(config)
    assert not (tmp_path / POLICY).exists()


@pytest.mark.usefixtures("prefect_server")
def test_an_artifact_the_api_refuses_is_a_warning_in_the_log_not_a_failed_run():
    import logging

    from prefect import flow
    from prefect.artifacts import create_table_artifact

    from pipeline.monitoring import artifacts

    @flow(name="refused-artifact")
    def publish_a_bad_key() -> str:
        artifacts.send(create_table_artifact, key="Not a key!", table=[{"rows": 1}])  # keys are lowercase-dashes
        bar = artifacts.ProgressArtifact.create("Not a key either", "refused too")
        bar.finish("done")  # an update of a bar that does not exist sends nothing
        artifacts.flush()
        return "finished"

    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("prefect.flow_runs").addHandler(handler)  # the flow's run logger
    try:
        assert publish_a_bad_key() == "finished"
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    messages = [record.getMessage() for record in warnings]
    assert len(messages) == 2 and all(m.startswith("Prefect artifact not sent: ValidationError") for m in messages)


@pytest.mark.usefixtures("prefect_server")
def test_artifacts_sent_late_reach_the_api_on_the_run_they_came_from(tmp_path):
    """Artifacts go out on a background thread through its own API client: one still queued
    when its flow has ended, here a flow that raised, is sent on the flow run it came from
    (through the run's own client, which closes with the run, it failed with "the client has
    been closed", and its warning landed in whatever ran next)."""
    import logging
    import threading

    from prefect import flow
    from prefect.artifacts import create_table_artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.context import get_run_context

    from pipeline.monitoring import artifacts

    raised = threading.Event()

    def slow_table() -> None:
        assert raised.wait(timeout=60)  # still queued when the flow raises: sent after it
        create_table_artifact(key="failed-flow-table", table=[{"rows": 1}], description=str(tmp_path))

    flow_runs = []

    @flow(name="failing-publisher")
    def fails_after_sending() -> None:
        flow_runs.append(get_run_context().flow_run.id)
        artifacts.send(slow_table)
        raise RuntimeError("a stage failed")

    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("prefect").addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="a stage failed"):
            fails_after_sending()
        raised.set()
        artifacts.flush()  # what sent_before_exit does as an outermost flow ends
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    assert not [r.getMessage() for r in warnings if "artifact" in r.getMessage()]
    with get_client(sync_client=True) as client:
        tables = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["failed-flow-table"]))
        )
    assert [a.flow_run_id for a in tables if a.description == str(tmp_path)] == flow_runs


PROCESS_ENDING_AFTER_ITS_FLOW = """
import json, sys, threading
from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.context import get_run_context
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from pipeline.monitoring import artifacts

subflow_ended = threading.Event()

def slow_table():
    assert subflow_ended.wait(timeout=60)  # still queued when the subflow has ended
    create_table_artifact(key="sent-before-exit", table=[{"rows": 1}], description=sys.argv[1])

@flow(name="sending-subflow")
@artifacts.sent_before_exit
def subflow():
    artifacts.send(slow_table)
    return str(get_run_context().flow_run.id)

@flow(name="outermost")
@artifacts.sent_before_exit
def outermost():
    sent_from = subflow()  # it returned with its artifact still queued: it does not wait for it
    subflow_ended.set()
    return sent_from

with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):  # as mtrl: a flow's end joins no heartbeat
    print(json.dumps(outermost()))
"""


@pytest.mark.slow  # a process of its own against a real server (about 16 s)
def test_a_process_ending_after_its_flow_sends_its_artifacts_and_their_events(tmp_path, prefect_server_env):
    """An artifact still queued when the outermost flow ends is sent before that flow returns:
    left to the interpreter's exit, it reached the API but Prefect's event for it failed with
    a traceback ("can't register atexit after shutdown"; seen in a fully cached `mtrl run`,
    whose last summary was still queued). The subflow does not wait for it: the outermost does."""
    import subprocess
    import sys

    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    script = tmp_path / "ends_after_its_flow.py"
    script.write_text(PROCESS_ENDING_AFTER_ITS_FLOW)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=prefect_server_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error emitting event" not in done.stderr, done.stderr[-3000:]
    subflow_run = json.loads(done.stdout.strip().splitlines()[-1])
    with SyncPrefectClient(prefect_server_env["PREFECT_API_URL"]) as client:
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sent-before-exit"])))
        [table] = [a for a in tables if a.description == str(tmp_path)]
        assert str(table.flow_run_id) == subflow_run
        assert client.read_flow_run(table.flow_run_id).end_time < table.created  # the subflow did not wait
