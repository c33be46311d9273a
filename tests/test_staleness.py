"""Bounded staleness (ppo.max_staleness K): iteration i's rollouts come from policy max(0, i - K)
on a fixed schedule, the next iteration's experience (rollouts, rewards, advantages) is made
while this one trains (real Prefect task runs, overlapping), and the update trains the newest
policy with the decoupled loss."""

from __future__ import annotations

import json

import pytest

from pipeline.orchestration.flows import rl_training
from pipeline.store.lineage import generating_policy, policies_before, policy_chain
from pipeline.store.versions import Store
from schemas.config import RunConfig
from stages.generate_rollouts.engine import ENGINE


def train(config: RunConfig, staleness: int, iterations: int) -> list[dict]:
    try:
        return rl_training(config.with_overrides({"iterations": iterations, "ppo.max_staleness": staleness}))
    finally:
        ENGINE.close()


def policy_numbers(store: Store, newest: str) -> dict[str, int]:
    """Policy version -> n, where policy n is the one n updates after the starting policy."""
    chain = [m.version for m in policy_chain(store, newest)][::-1]
    return {version: n for n, version in enumerate(chain)}


@pytest.mark.parametrize("staleness, iterations", [(1, 3), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_iteration_i_is_generated_by_policy_i_minus_k_and_trains_policy_i(
    small_config, prefect_server, staleness, iterations
):
    results = train(small_config, staleness, iterations)
    store = Store(small_config.store.runs_dir)
    number = policy_numbers(store, results[-1]["next_policy"])
    for i, result in enumerate(results):
        update = store.manifest("ppo-update", result["versions"]["ppo-update"])
        generating = generating_policy(store, "ppo-update", update.version)
        assert number[generating] == max(0, i - staleness) == number[result["generating_policy"]]
        assert number[update.parents["policy"]] == i  # the newest policy trains
        assert update.extra("staleness") == i - max(0, i - staleness)
        # every rollout of a stale iteration is the older policy's, checked against it by the audit
        turns = store.load("compute-advantages", update.parents["compute-advantages"])
        assert set(turns["policy_version"]) == {generating}
        assert update.extra("audit")["rescore_max_abs_diff"] <= 1e-3
        # the decoupled loss: old logprobs are the trained policy's own, recomputed, when it did not generate
        assert update.extra("old_logprobs") == ("recomputed" if i > 0 else "generation")
        # its memory figure is the process's while the next batch was made beside it (not at the last)
        beside = "the process, with the next batch made beside it"
        assert update.extra("memory")["scope"] == ("this stage" if i == iterations - 1 else beside)
        assert {m.parents["policy"] for m in store.versions("generate-rollouts") if m.iteration == i} == {generating}
    # the schedule is a pure function of the lineage: the same query gives the same policy
    assert policies_before(store, results[-1]["policy"], staleness)[-1] == results[-1]["generating_policy"]
    assert policies_before(store, results[0]["policy"], staleness) == [results[0]["policy"]] * (staleness + 1)
    assert policies_before(store, results[-1]["policy"], staleness)[0] == results[-1]["policy"]


def test_the_next_iterations_experience_is_made_while_this_one_trains(small_config, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    results = train(small_config, staleness=1, iterations=2)
    store = Store(small_config.store.runs_dir)
    first, second = results  # iteration 1's rollouts are policy 0's
    assert second["generating_policy"] == first["policy"]
    runs_dir = str(small_config.store.runs_dir)
    with get_client(sync_client=True) as client:
        (flow_run,) = [  # this test's iteration 0
            run
            for run in client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC)  # the newest 200: the server is shared
            if run.parameters.get("iteration") == 0 and run.parameters["config"]["store"]["runs_dir"] == runs_dir
        ]
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    by_name: dict[str, list] = {}
    for run in task_runs:
        assert run.state.is_completed(), f"{run.name}: {run.state}"
        by_name.setdefault(run.name.rsplit("-", 1)[0], []).append(run)
    # flow run 0 made iteration 0's experience, then iteration 1's beside its ppo-update
    (update,) = by_name["ppo-update"]
    first_made = min(r.end_time for r in by_name["compute-advantages"])  # iteration 0's advantages
    ahead = [r for name in ("generate-rollouts", "execute-tools", "assign-rewards", "compute-advantages")
             for r in by_name[name] if r.start_time >= first_made]  # fmt: skip
    turns = [m for m in store.versions("generate-rollouts") if m.iteration == 1]
    assert len([r for r in ahead if r.name.startswith("generate-rollouts")]) == len(turns)
    assert len([r for r in ahead if r.name.startswith("compute-advantages")]) == 1
    # ... running while ppo-update ran
    assert min(r.start_time for r in ahead) < update.end_time and max(r.end_time for r in ahead) > update.start_time
    assert second["versions"]["compute-advantages"] in {m.version for m in store.versions("compute-advantages")}


def test_staleness_needs_the_trained_policys_own_old_logprobs():
    with pytest.raises(ValueError, match="max_staleness=1 with recompute_old_logprobs=false"):
        RunConfig(ppo={"max_staleness": 1, "recompute_old_logprobs": False})


@pytest.mark.slow
def test_a_value_head_and_lora_adapters_built_beside_the_next_batch_give_the_same_bytes_every_run(
    small_config, prefect_server, tmp_path, capsys
):
    """With K = 1 the next batch's advantages (GAE: a value head built and scored) are made while
    ppo-update builds its LoRA adapters and value head: both draw from torch's global generator
    and transformers patches torch.nn.init while it loads. Two runs must still be the same bytes."""
    from pipeline.cli.main import main

    runs = []
    for name in ("a", "b"):
        config = small_config.with_overrides(
            {"store.runs_dir": str(tmp_path / name), "advantage.estimator": "gae", "ppo.lora_rank": 4}
        )
        train(config, staleness=1, iterations=3)
        runs.append(str(tmp_path / name))
    capsys.readouterr()
    assert main(["diff", *runs]) == 0
    assert capsys.readouterr().out.strip().endswith(" 0 different")


@pytest.mark.slow  # three iterations
def test_an_audit_failure_in_the_batch_made_ahead_fails_its_own_iteration_after_the_update_beside_it(
    small_config, prefect_server, monkeypatch
):
    """Iteration 2's batch, made beside iteration 1's update, fails the audit (planted by the test):
    rl-iteration 1 still completes (update stored, AdamW states pruned, summary written) and the
    failure is rl-iteration 2's, whose ppo-update audits the batch before it trains."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from pipeline.orchestration import stage_runs
    from pipeline.store.audit import AuditError
    from pipeline.store.retention import optimizer_state_gone

    config = small_config.with_overrides({"store.keep_optimizer_state": 1})
    audited = []

    def audit_failing_iteration_2(store, version, config, seed):
        audited.append(seed - config.seed)
        if seed == config.seed + 2:
            raise AuditError(f"compute-advantages/{version} fails the audit: planted by the test")
        return real_audit(store, version, config, seed)

    real_audit = stage_runs.audit_before_training  # ppo-update's task audits its batch (write_version)
    monkeypatch.setattr(stage_runs, "audit_before_training", audit_failing_iteration_2)
    with pytest.raises(AuditError, match="planted by the test"):
        train(config, staleness=1, iterations=3)
    # each batch once, by the ppo-update of its own iteration: batch 2, made beside update 1, fails
    # in rl-iteration 2, never in the iteration it was made beside
    assert audited == [0, 1, 2]
    store = Store(config.store.runs_dir)
    updates = sorted(store.versions("ppo-update"), key=lambda m: m.iteration)
    assert [m.iteration for m in updates] == [0, 1]
    policy_1, policy_2 = updates[0].policy, updates[1].policy
    assert optimizer_state_gone(store, policy_1) is not None and optimizer_state_gone(store, policy_2) is None
    summary = json.loads((config.store.runs_dir / "report" / "summary.json").read_text())
    assert [row["iteration"] for row in summary] == [0, 1]
    runs_dir = str(config.store.runs_dir)
    with get_client(sync_client=True) as client:
        states = {
            run.parameters["iteration"]: run.state.type.value
            for run in client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC)  # the newest 200: the server is shared
            if run.flow_id
            and run.parameters.get("config", {}).get("store", {}).get("runs_dir") == runs_dir
            and "iteration" in run.parameters
        }
    assert states == {0: "COMPLETED", 1: "COMPLETED", 2: "FAILED"}
