"""sft: the warm start. Supervised fine-tuning of the starting policy on environment
demonstrations, so that RL starts from a model that knows the tool-call format (as verl, TRL
and OpenRLHF offer an SFT trainer before RL). One row of metrics per optimiser step.

Each demonstration (`Environment.demonstration(task)`: an expert conversation, tool calls and
tool results included) becomes the token stream a rollout of it would hold
(docs/token-stream.md): the prompt, then per assistant message the tokens the model would
sample (`schemas.token_stream.assistant_token_ids`, ending with EOS), then the observation's
delta tokens and the next generation prompt. The model is trained on exactly the layout it
generates in, whatever its chat template does with earlier turns, and the loss covers the
assistant tokens only: the negative log-likelihood, scored through the path PPO uses
(`stages.policy.scoring.forward_targets`, at temperature 1).

The optimiser is a fresh AdamW and its state is not stored: RL starts a fresh one from the
result, as from an imported model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.memory import peak_memory
from runtime.phases import PHASES
from schemas.features import SFT, dataset_from_rows
from schemas.stage import POLICY, Inputs, Output, Settings, Stage, read
from schemas.task_mix import TaskMix
from schemas.token_stream import assistant_token_ids, generation_prompt_ids, observation_token_ids, prompt_token_ids
from stages.environments import Environment
from stages.policy.batching import RolloutSequence, collate, micro_batches, shares_prefix, training_memory
from stages.policy.loading import Device, load_model, load_tokenizer
from stages.policy.scoring import forward_targets
from stages.registry import Tasks, tool_schemas

LOGPROB_CHUNK_TOKENS = 1024  # tokens per chunk of the vocabulary projection: bounds memory, not the result
Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (messages, tool schemas)


Demonstrator = tuple[Environment, list[dict[str, Any]], float]  # an environment, its prompts' tool schemas, a weight


class DemonstrationTasks(Tasks):
    mix: TaskMix = read("sft.task", "task.name")  # the warm start's task mix may differ from RL's


class SFTSettings(Settings):
    tasks: DemonstrationTasks  # what the demonstrations are of, and the code that writes them
    steps: int = read("sft.steps")
    batch_size: int = read("sft.batch_size")
    learning_rate: float = read("sft.learning_rate")
    warmup_steps: int = read("sft.warmup_steps")
    max_grad_norm: float = read("sft.max_grad_norm")
    gradient_checkpointing: bool | None = read("sft.gradient_checkpointing")  # null: the memory rule
    max_tokens_per_micro_batch: int | None = read("sft.max_tokens_per_micro_batch")  # null: the memory rule
    share_prefix: bool = read("sft.share_prefix")
    seed: int = read("seed")
    enable_thinking: bool = read("generation.enable_thinking")  # it shapes the demonstrations' tokens
    device: Device = read("model.device")


def demonstrators(tasks: Tasks) -> list[Demonstrator]:
    """The environments of the warm start's task mix, as the run sets them up (task.options,
    task.tools), with the tool schemas their prompts show and their weights."""
    tools = tasks.tools()
    mix = [(tasks.environment(name), weight) for name, weight in tasks.mix]
    return [(found, tool_schemas(found, tools), weight) for found, weight in mix]


def check_demonstrations(tasks: list[Demonstrator]) -> None:
    """Every environment of the warm start's mix can demonstrate its task (one is made to see)."""
    for demonstrator, _, _ in tasks:
        if type(demonstrator).demonstration is Environment.demonstration:
            raise ValueError(
                f"sft: environment '{demonstrator.name}' has no demonstration(task), so there is nothing to fine-tune "
                "on; set sft.task to environments that have one, or sft.steps=0"
            )
        try:
            demonstrator.demonstration(demonstrator.sample_task(random.Random(0)))
        except Exception as exc:  # e.g. a reasoning-gym generator without gold answers
            raise ValueError(f"sft: environment '{demonstrator.name}' cannot demonstrate its task: {exc}") from None


def sample_demonstrations(tasks: list[Demonstrator], rng: random.Random, count: int) -> list[Conversation]:
    """`count` demonstrations of freshly sampled tasks, each environment drawn by its weight."""
    conversations = []
    for _ in range(count):
        demonstrator, schemas, _ = rng.choices(tasks, [weight for _, _, weight in tasks])[0]
        conversations.append((demonstrator.demonstration(demonstrator.sample_task(rng)), schemas))
    return conversations


def demonstration_sequence(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], enable_thinking: bool
) -> RolloutSequence:
    """The token stream a rollout of this conversation holds, with its assistant tokens as the
    targets: the prompt of the messages before the first assistant turn, then per assistant
    turn its completion tokens; between two assistant turns the observation's delta tokens
    (tool results, environment replies) and the generation prompt. Messages after the last
    assistant turn are left out: a rollout ends with its last completion."""
    first = next((i for i, message in enumerate(messages) if message["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant message")
    sequence = RolloutSequence(token_ids=prompt_token_ids(tokenizer, messages[:first], tools, enable_thinking))
    observation: list[dict[str, Any]] | None = None  # the messages since the last assistant turn
    for message in messages[first:]:
        if message["role"] != "assistant":
            observation = [*(observation or []), message]
            continue
        if observation is not None:  # not the first turn: the observation, then the next turn opens
            sequence.token_ids += observation_token_ids(tokenizer, observation)
            sequence.token_ids += generation_prompt_ids(tokenizer, enable_thinking)
        completion = assistant_token_ids(tokenizer, message, enable_thinking)
        sequence.target_positions += range(len(sequence.token_ids), len(sequence.token_ids) + len(completion))
        sequence.token_ids += completion
        observation = []
    return sequence


def accumulate_gradients(
    model: torch.nn.Module,
    sequences: list[RolloutSequence],
    pad_token_id: int,
    max_tokens: int,
    share_prefix: bool = False,
) -> float:
    """Backward the step's loss, the mean negative log-likelihood of the sequences' assistant
    tokens, in passes of at most `max_tokens` tokens, packed (0: one padded pass of them all),
    their common prefix computed once with share_prefix (where the model allows: shares_prefix);
    the gradients add up to the one pass's. Returns the loss."""
    device = next(model.parameters()).device
    tokens = sum(len(sequence.target_positions) for sequence in sequences)
    share_prefix = share_prefix and shares_prefix(model)
    loss = 0.0
    for micro in micro_batches(sequences, len(sequences), max_tokens, share_prefix):
        batch = collate(micro, pad_token_id, device, packed=max_tokens > 0, share_prefix=share_prefix)
        logprobs, _, _ = forward_targets(model, batch, 1.0, LOGPROB_CHUNK_TOKENS)
        share = -logprobs.sum() / tokens  # this pass's share of the mean over the step's tokens
        share.backward()
        loss += share.item()
    return loss


def train_on_demonstrations(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: SFTSettings,
    tasks: list[Demonstrator],
    report_progress: Callable[[float], None] | None = None,
) -> list[dict[str, float]]:
    """Optimise `model` in place for settings.steps AdamW steps, each on settings.batch_size fresh
    demonstrations (seeded: the same seed trains on the same ones); the loss is the mean
    negative log-likelihood of their assistant tokens, its gradient accumulated over passes of at
    most settings.max_tokens_per_micro_batch tokens (0 or null: one padded pass). Returns one
    metrics dict per step."""
    torch.manual_seed(settings.seed)
    rng = random.Random(f"sft/{settings.seed}")  # apart from the RL iterations' task seeds ("tasks/...")
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=0.0)
    if settings.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    metrics: list[dict[str, float]] = []
    for step in range(settings.steps):
        learning_rate = settings.learning_rate * min(1.0, (step + 1) / (settings.warmup_steps + 1))
        optimizer.param_groups[0]["lr"] = learning_rate
        sequences = [
            demonstration_sequence(tokenizer, messages, tools, settings.enable_thinking)
            for messages, tools in sample_demonstrations(tasks, rng, settings.batch_size)
        ]
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(
            model, sequences, tokenizer.pad_token_id, settings.max_tokens_per_micro_batch or 0, settings.share_prefix
        )
        norm = torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm)
        optimizer.step()
        metrics.append(
            {
                "step": step,
                "demonstrations": len(sequences),
                "tokens": sum(len(sequence.target_positions) for sequence in sequences),
                "learning_rate": learning_rate,
                "loss": loss,
                "grad_norm": float(norm),
            }
        )
        if report_progress is not None:
            report_progress((step + 1) / settings.steps)
    optimizer.zero_grad(set_to_none=True)
    if settings.gradient_checkpointing:
        model.activation_checkpointing_disable()
    model.eval()
    return metrics


def metrics_summary(metrics: list[dict[str, float]]) -> dict[str, float]:
    """For the manifest: the loss of the first and the last step, and the tokens trained on."""
    if not metrics:
        return {}
    return {
        "first_loss": metrics[0]["loss"],
        "last_loss": metrics[-1]["loss"],
        "tokens": sum(row["tokens"] for row in metrics),
    }


@dataclass
class FineTunedPolicy:
    model: torch.nn.Module
    tokenizer: Any
    metrics: list[dict[str, float]]  # one row per optimiser step

    def save(self, directory: Path) -> dict[str, Any]:
        """The checkpoint and its tokenizer (its chat template): no AdamW state, no value head."""
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return {}


def supervised_fine_tune(
    policy_dir: str | Path, settings: SFTSettings, report_progress: Callable[[float], None] | None = None
) -> FineTunedPolicy:
    """sft: load the policy (float32), train it on demonstrations of the settings' tasks, and return
    it ready to save as a new policy."""
    model, tokenizer = load_model(policy_dir, "float32", settings.device), load_tokenizer(str(policy_dir))
    settings = training_memory(settings, policy_dir, settings.device)  # null memory fields: as ppo-update's
    tasks = demonstrators(settings.tasks)
    metrics = train_on_demonstrations(model, tokenizer, settings, tasks, report_progress)
    return FineTunedPolicy(model, tokenizer, metrics)


def run(inputs: Inputs, settings: SFTSettings, report_progress: Callable[[float], None] | None = None) -> Output:
    """The warm start: fine-tune the starting policy (input "policy") on demonstrations; its result
    is a policy of iteration -1 (RL's iteration 0 trains it), with the per-step metrics."""
    policy_dir = inputs.folder(POLICY)  # its files checked once, here
    chosen = training_memory(settings, policy_dir, settings.device)
    with peak_memory() as memory, PHASES.span("stage_compute"):
        trained = supervised_fine_tune(policy_dir, settings, report_progress)
    fields = {
        "iteration": -1,
        "metrics": metrics_summary(trained.metrics),
        "memory": memory,
        # what gradient_checkpointing / max_tokens_per_micro_batch were (null: chosen by the model's size)
        "memory_settings": chosen.model_dump(include={"gradient_checkpointing", "max_tokens_per_micro_batch"}),
    }
    return Output(dataset_from_rows(trained.metrics, SFT), fields, save_policy=trained.save)


STAGE = Stage(
    name="sft",
    inputs=(POLICY,),  # the imported starting policy
    features=SFT,
    settings=SFTSettings,
    run=run,
    writes_policy=True,
)
