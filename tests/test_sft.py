"""The warm start (sft): demonstrations become exactly the token streams rollouts hold, the loss
covers the assistant tokens only and goes down, and the result is a stored, cached policy with
its lineage that RL starts from (and takes as its KL reference)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pipeline.models.base_model import EMBEDDED_POLICY
from schemas.config import RunConfig
from schemas.token_stream import rollouts
from stages.environments import ENVIRONMENTS, CalculatorEnv, Environment
from stages.policy.batching import collate, micro_batches
from stages.policy.loading import load_model, load_tokenizer
from stages.policy.scoring import forward_targets
from stages.registry import tool_schemas
from stages.sft import (
    DemonstrationTasks,
    SFTSettings,
    accumulate_gradients,
    check_demonstrations,
    demonstration_sequence,
    demonstrators,
    sample_demonstrations,
    train_on_demonstrations,
)
from stages.tools import TOOLS


def tasks(name: str) -> list:
    """The warm start's environments of a task mix, as a run with it sets them up."""
    return demonstrators(DemonstrationTasks.resolve(RunConfig(task={"name": name})))


def calculator_demonstration() -> tuple[list[dict], list[dict], dict]:
    environment = ENVIRONMENTS["calculator"]
    task = {"question": "What is 12+30-5?", "expression": "12+30-5", "answer": 37}
    return environment.demonstration(task), tool_schemas(environment, TOOLS), task


def test_the_loss_covers_exactly_the_assistant_turns_of_a_demonstration(tiny):
    """Checked by hand on one calculator demonstration: the targets decode to the two assistant
    turns as the model writes them (think block, Hermes tool call, EOS), and everything else to
    the prompt, the tool result's delta and the generation prompt."""
    _, tokenizer = tiny
    messages, tools, _ = calculator_demonstration()
    sequence = demonstration_sequence(tokenizer, messages, tools, enable_thinking=True)
    targets = set(sequence.target_positions)
    trained = tokenizer.decode([t for i, t in enumerate(sequence.token_ids) if i in targets])
    first_turn = (
        "<think>\nThe user wants 12+30-5. I will use the calculate tool.\n</think>\n\n"
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12+30-5"}}\n</tool_call><|im_end|>'
    )
    second_turn = "<think>\nThe tool returned 37.\n</think>\n\nThe result is 37.<|im_end|>"
    assert trained == first_turn + second_turn
    assert len(targets) == len(tokenizer.encode(first_turn)) + len(tokenizer.encode(second_turn))
    read_only = tokenizer.decode([t for i, t in enumerate(sequence.token_ids) if i not in targets])
    assert read_only.endswith(
        "<|im_start|>user\nWhat is 12+30-5?<|im_end|>\n<|im_start|>assistant\n"  # the prompt's end
        "\n<|im_start|>user\n<tool_response>\n37\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # with thinking off the generation prompt holds the empty think block: no reasoning is trained
    quiet = demonstration_sequence(tokenizer, messages, tools, enable_thinking=False)
    quiet_targets = tokenizer.decode([quiet.token_ids[i] for i in quiet.target_positions])
    assert "<think>" not in quiet_targets and quiet_targets.endswith("The result is 37.<|im_end|>")


@pytest.mark.parametrize("task", ["calculator", "guess-number", "weather"])
def test_a_demonstration_is_the_stream_its_chat_template_renders(tiny, task):
    """For the embedded model's template (Qwen3's format) a rollout's stream equals the rendering
    of its whole conversation; so must a demonstration's, token for token, less the newline the
    template puts after the last EOS (a rollout ends at its EOS)."""
    _, tokenizer = tiny
    ((messages, tools),) = sample_demonstrations(tasks(task), random.Random(3), 1)
    sequence = demonstration_sequence(tokenizer, messages, tools, enable_thinking=True)
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert sequence.token_ids == tokenizer.encode(rendered.removesuffix("\n"), add_special_tokens=False)
    assert sequence.token_ids[sequence.target_positions[-1]] == tokenizer.eos_token_id


def test_greedy_rollouts_of_the_calculator_expert_are_its_demonstrations_token_for_token():
    """The committed expert checkpoint was trained on calculator demonstrations: decoding it
    greedily through the rollout machinery (generate-rollouts, execute-tools) gives, for the
    rollouts it solves, exactly the tokens of their tasks' demonstrations, targets included."""
    from pipeline.cli.embedded_build import EXPERT_DIR
    from pipeline.orchestration.episodes import run_episodes
    from stages.generate_rollouts.hf import HFEngine
    from stages.policy.loading import eos_token_ids

    model, tokenizer = load_model(EXPERT_DIR, "float32", "cpu"), load_tokenizer(EXPERT_DIR)
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    config = RunConfig(
        task={"rollouts": 8, "group_size": 1, "max_turns": 3}, generation={"top_k": 1, "max_new_tokens": 64}
    )
    turns = run_episodes(engine, tokenizer, config)
    payloads = {row["rollout_id"]: json.loads(row["task_payload"]) for row in turns}
    solved = {row["rollout_id"] for row in turns if row["reward"] == 1.0}
    assert len(solved) >= 6, f"the expert solved {len(solved)} of 8 greedily"
    for rollout in rollouts(turns):
        if rollout.rollout_id not in solved:
            continue
        environment = ENVIRONMENTS["calculator"]
        messages = environment.demonstration(payloads[rollout.rollout_id])
        sequence = demonstration_sequence(tokenizer, messages, tool_schemas(environment, TOOLS), enable_thinking=True)
        assert rollout.token_ids == sequence.token_ids, rollout.rollout_id
        sampled = [p for start, end in rollout.completion_spans for p in range(start, end)]
        assert sampled == sequence.target_positions


def held_out_loss(model: torch.nn.Module, tokenizer, seed: int) -> float:
    """Mean negative log-likelihood of the assistant tokens of 8 fixed demonstrations."""
    conversations = sample_demonstrations(tasks("calculator"), random.Random(f"held-out/{seed}"), 8)
    sequences = [demonstration_sequence(tokenizer, m, t, enable_thinking=True) for m, t in conversations]
    with torch.no_grad():
        logprobs, _, _ = forward_targets(
            model, collate(sequences, tokenizer.pad_token_id, torch.device("cpu")), 1.0, 1024
        )
    return -logprobs.mean().item()


def test_sft_lowers_the_loss_on_demonstrations_it_did_not_see_and_moves_every_layer(tiny):
    """The embedded policy was fine-tuned on flawed calculator episodes: a few steps on correct
    ones lower the loss on held-out demonstrations."""
    _, tokenizer = tiny
    model = load_model(EMBEDDED_POLICY, "float32", "cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss_before = held_out_loss(model, tokenizer, seed=0)
    config = RunConfig(
        seed=0,
        generation={"enable_thinking": True},
        sft={"steps": 6, "batch_size": 4, "learning_rate": 1e-4, "warmup_steps": 1},
    )
    metrics = train_on_demonstrations(model, tokenizer, SFTSettings.resolve(config), tasks=tasks("calculator"))
    assert [row["step"] for row in metrics] == list(range(6))
    assert metrics[0]["learning_rate"] == pytest.approx(5e-5) and metrics[1]["learning_rate"] == pytest.approx(1e-4)
    assert all(row["demonstrations"] == 4 and row["tokens"] > 0 for row in metrics)
    assert sum(row["loss"] for row in metrics[-2:]) / 2 < metrics[0]["loss"]
    loss_after = held_out_loss(model, tokenizer, seed=0)
    print(f"held-out loss per assistant token {loss_before:.4f} -> {loss_after:.4f}")
    assert loss_after < 0.8 * loss_before
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) == len(before)


def test_a_steps_gradient_over_packed_passes_of_a_token_budget_is_the_one_pass_gradient(tiny):
    """sft.max_tokens_per_micro_batch: the step's demonstrations in packed passes of at most N
    tokens (memory follows the budget) give the loss and the gradients of one padded pass."""
    _, tokenizer = tiny
    sequences = [
        demonstration_sequence(tokenizer, messages, tools, True)
        for messages, tools in sample_demonstrations(tasks("calculator,guess-number"), random.Random(0), 6)
    ]
    longest = max(len(sequence.token_ids) for sequence in sequences)
    losses, gradients = [], []
    # one padded pass; packed passes of about two demonstrations; the same with their common
    # prefix (the system prompt and tools) computed once, padded and packed
    ways = [(0, False), (longest + 10, False), (0, True), (longest + 10, True)]
    for max_tokens, share_prefix in ways:
        model = load_model(EMBEDDED_POLICY, "float32", "cpu")
        losses.append(accumulate_gradients(model, sequences, tokenizer.pad_token_id, max_tokens, share_prefix))
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    assert len(micro_batches(sequences, len(sequences), longest + 10)) > 1
    for loss, grads in zip(losses[1:], gradients[1:]):
        assert loss == pytest.approx(losses[0], abs=1e-5)
        for name, one_pass in gradients[0].items():
            torch.testing.assert_close(grads[name], one_pass, rtol=1e-4, atol=1e-6, msg=name)


def test_the_warm_start_is_versioned_apart_from_the_rl_stages():
    """sft's settings reach the RL stages only through the policy it writes; its own version
    follows its demonstrations' task mix (sft.task, else task.name)."""
    from pipeline.orchestration.stage_runs import settings_of
    from pipeline.orchestration.stage_table import STAGES
    from pipeline.orchestration.stage_table import stage_version as version_of

    def stage_version(config: RunConfig, name: str, parents: dict, position: dict) -> str:
        return version_of(name, settings_of(name, config), parents, position)

    base, warm = RunConfig(), RunConfig().with_overrides({"sft.steps": 20, "sft.learning_rate": 1e-3})
    for name in STAGES:
        same = stage_version(base, name, {}, {}) == stage_version(warm, name, {}, {})
        assert same == (name != "sft"), name
    assert stage_version(warm.with_overrides({"task.name": "weather"}), "sft", {}, {}) != stage_version(
        warm, "sft", {}, {}
    )
    # an explicit sft.task keeps the warm start when only the RL task changes
    explicit = warm.with_overrides({"sft.task": "calculator"})
    assert stage_version(explicit, "sft", {}, {}) == stage_version(
        explicit.with_overrides({"task.name": "weather"}), "sft", {}, {}
    )


def test_mtrl_sft_without_steps_or_with_an_unknown_task_is_one_line(tmp_path, capsys):
    from pipeline.cli.main import main

    runs = str(tmp_path / "runs")
    assert main(["sft", "--runs-dir", runs]) == 2
    assert "give --sft-steps N" in capsys.readouterr().err
    assert main(["sft", "--runs-dir", runs, "--sft-steps", "2", "--set", "sft.task=calculator:2,nope"]) == 2
    assert "unknown task 'nope'; valid: calculator, guess-number, weather" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "sft").exists()


class WithoutDemonstrationEnv(CalculatorEnv):
    name, demonstration = "without-demonstration", Environment.demonstration


def test_a_task_without_demonstrations_cannot_warm_start():
    ENVIRONMENTS[WithoutDemonstrationEnv.name] = WithoutDemonstrationEnv()
    try:
        with pytest.raises(ValueError, match="environment 'without-demonstration' has no demonstration"):
            check_demonstrations(tasks("calculator,without-demonstration"))
    finally:
        del ENVIRONMENTS[WithoutDemonstrationEnv.name]
    check_demonstrations(tasks("calculator,guess-number,weather"))


@pytest.mark.usefixtures("prefect_server")
def test_rl_starts_from_the_stored_warm_start_which_is_its_kl_reference(small_config):
    import shutil

    from pipeline.orchestration.flows import rl_training, warm_start
    from pipeline.orchestration.stage_table import POLICY
    from pipeline.store.lineage import reference_policy
    from pipeline.store.versions import Store

    config = small_config.with_overrides({"sft.steps": 2, "sft.batch_size": 2, "ppo.kl_coef": 0.05})
    store = Store(config.store.runs_dir)
    (result,) = rl_training(config)

    warm = result["policy"]  # the policy iteration 0 generated with
    policy = store.manifest(POLICY, warm)
    assert policy.iteration == -1 and set(policy.parents) == {"sft"}
    trained = store.manifest("sft", policy.parents["sft"])
    base = trained.parents[POLICY]
    assert trained.iteration == -1 and trained.policy == warm and trained.rows == 2
    assert store.manifest(POLICY, base).imported_from is not None
    assert not (store.path(POLICY, warm) / "optimizer.safetensors").exists()  # RL starts a fresh AdamW
    update = store.manifest("ppo-update", result["versions"]["ppo-update"])
    assert update.iteration == 0 and update.parents[POLICY] == warm and update.extra("optimizer_state_restored") == 0
    advantaged = store.manifest("compute-advantages", result["versions"]["compute-advantages"])
    assert advantaged.parents[f"{POLICY}#reference"] == warm == reference_policy(store, result["next_policy"])
    chain = [f"{m.stage}/{m.version}" for m in store.lineage(POLICY, result["next_policy"])]
    assert chain[-3:] == [f"policy/{warm}", f"sft/{trained.version}", f"policy/{base}"]

    # the same settings again: found in the store, not trained again
    versions = {(m.stage, m.version, m.created_at) for m in store.versions()}
    assert warm_start(config) == warm
    assert {(m.stage, m.version, m.created_at) for m in store.versions()} == versions
    # a deleted warm start is trained again into the same bytes
    files = policy.files
    shutil.rmtree(store.path(POLICY, warm))
    assert warm_start(config) == warm and store.manifest(POLICY, warm).files == files
