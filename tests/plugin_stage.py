"""A stage that mtrl does not ship, declared the way docs/extending.md shows: one module, then one
registration line (tests/test_pipeline.py registers it and re-runs it with `mtrl stage`)."""

from __future__ import annotations

from datasets import Features, Value

from schemas.stage import Inputs, Output, Settings, Stage, read

FEATURES = Features({"rollout_id": Value("int64"), "turn": Value("int32"), "budget_used": Value("float32")})


class BudgetSettings(Settings):
    max_new_tokens: int = read("generation.max_new_tokens")


def run(inputs: Inputs, settings: BudgetSettings) -> Output:
    """Per turn of the rewarded rollouts, the share of the token budget its completion used."""
    turns = inputs.load("assign-rewards").select_columns(["rollout_id", "turn", "completion_token_ids"]).to_list()
    rows = {
        "rollout_id": [row["rollout_id"] for row in turns],
        "turn": [row["turn"] for row in turns],
        "budget_used": [len(row["completion_token_ids"]) / settings.max_new_tokens for row in turns],
    }
    from datasets import Dataset

    dataset = Dataset.from_dict(rows, features=FEATURES)
    return Output(dataset, {"metrics": {"budget_used_max": max(rows["budget_used"], default=0.0)}})


STAGE = Stage(
    name="token-budget",
    inputs=("assign-rewards",),
    features=FEATURES,
    settings=BudgetSettings,
    run=run,
    rerun_from="assign-rewards",
)
