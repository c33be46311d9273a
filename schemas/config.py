"""The one run configuration: a pydantic model with a section per part of the pipeline.

Loaded from YAML (`mtrl run --config FILE`), overridden by CLI flags, and used as the
Prefect flow's parameter schema. Every field has a type, a range, a description and a
default that works for the CPU demo. Each stage hashes only its own section(s) into its
version, so changing the estimator leaves rollouts cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, merging nested mappings (partial configs) key by key."""
    merged = dict(base)
    for key, value in top.items():
        both_mappings = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = deep_merge(base[key], value) if both_mappings else value
    return merged


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local HF causal-LM directory or hub id; empty means the embedded tiny model."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype for generation.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy runs; auto picks cuda if present."
    )


class TaskConfig(Section):
    name: str = Field(
        "calculator",
        description="Environment, or a weighted mix: 'calculator', 'calculator,guess-number', 'calculator:3,weather:1'.",
    )
    rollouts: int = Field(64, ge=1, le=100_000, description="Rollouts per iteration (tasks x group size).")
    group_size: int = Field(
        8, ge=1, le=1024, description="Samples of the same task; group-relative baselines use them."
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="Assistant turns before a rollout is cut (max-turns); null = each environment's own limit "
        "(calculator and weather 4, guess-number 50).",
    )
    plugins: list[str] = Field(
        default_factory=list, description="Python modules imported first; they register tools and environments."
    )

    @model_validator(mode="after")
    def _groups_divide_rollouts(self) -> TaskConfig:
        if self.rollouts % self.group_size:
            raise ValueError(f"rollouts ({self.rollouts}) must be a multiple of group_size ({self.group_size})")
        self.mix()  # raises on a malformed mix
        return self

    def mix(self) -> list[tuple[str, float]]:
        """(environment, weight) pairs of `name`; weights default to 1."""
        pairs = []
        for part in self.name.split(","):
            env, _, weight = part.strip().partition(":")
            try:
                value = float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"task '{part}': the weight after ':' must be a number") from None
            if not env or value <= 0:
                raise ValueError(f"task '{part}': expected NAME or NAME:WEIGHT with a positive weight")
            pairs.append((env, value))
        return pairs

    def groups_per_task(self) -> list[str]:
        """The environment of each group: weights split the groups by largest remainder."""
        mix, n_groups = self.mix(), self.rollouts // self.group_size
        total = sum(weight for _, weight in mix)
        exact = [n_groups * weight / total for _, weight in mix]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(len(mix)), key=lambda i: (counts[i] - exact[i], i))
        for i in by_remainder[: n_groups - sum(counts)]:
            counts[i] += 1
        return [env for (env, _), count in zip(mix, counts) for _ in range(count)]


class GenerationConfig(Section):
    engine: str = Field(
        "hf",
        description="Generation engine by name (stages/generate_rollouts/engine.py): hf = in-process Hugging Face "
        "model with per-rollout KV caches, the exact reference.",
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature; logprobs use the same.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(96, ge=1, le=65536, description="Tokens per assistant turn.")
    max_context_tokens: int = Field(4096, ge=16, description="Context budget of a rollout; beyond it: truncated.")
    enable_thinking: bool = Field(True, description="Chat template flag; False pre-fills an empty <think> block.")


class ToolsConfig(Section):
    timeout_s: float = Field(5.0, gt=0.0, le=3600.0, description="Wall-clock limit per tool call.")
    max_output_chars: int = Field(2000, ge=16, description="Tool output beyond this is truncated (and marked).")
    sandbox: bool = Field(True, description="Run each call in its own killable process (else in a thread).")
    memory_mb: int = Field(512, ge=16, description="Memory a sandboxed tool call may add.")


class RewardConfig(Section):
    truncated_reward: float = Field(
        0.0, ge=-1e6, le=1e6, description="Final reward of a rollout cut by its turn limit or the context budget."
    )
    overlong_reward: float = Field(
        -0.5,
        ge=-1e6,
        le=1e6,
        description="Final reward of a rollout whose turn ran past max_new_tokens without ending (as DAPO's "
        "overlong penalty): below a natural end, so rambling never beats answering.",
    )


class AdvantageConfig(Section):
    estimator: str = Field("grpo", description="grpo | rloo | reinforce++ | reinforce++-baseline | gae")
    normalize_by_std: bool = Field(True, description="GRPO: divide by the group std (False = Dr. GRPO).")
    epsilon: float = Field(1e-6, gt=0.0, description="Added to a std before dividing by it.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount per assistant token (gae, reinforce++).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    whiten_gae: bool = Field(True, description="GAE: whiten advantages over the batch.")


class PPOConfig(Section):
    learning_rate: float = Field(
        1e-4,
        gt=0.0,
        le=1.0,
        description="AdamW learning rate (one AdamW continues across iterations: its state is saved with each policy).",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    epochs: int = Field(1, ge=1, le=100, description="Passes over the iteration's rollouts.")
    minibatch_rollouts: int = Field(16, ge=1, description="Rollouts per optimiser step.")
    micro_batch_rollouts: int = Field(16, ge=1, description="Rollouts per forward/backward (gradient accumulation).")
    max_tokens_per_micro_batch: int = Field(
        0,
        ge=0,
        description="Pack rollouts into forward/backward passes of at most this many tokens, no padding "
        "(0 = micro_batch_rollouts padded rollouts per pass).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute layer activations in the backward pass (less memory, more compute)."
    )
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="Ratio clip below 1 (epsilon_low).")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="Ratio clip above 1 (epsilon_high, clip-higher).")
    clip_ratio_c: float | None = Field(3.0, gt=1.0, description="Dual clip for negative advantages (null = off).")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become one number."
    )
    loss_norm_tokens: int = Field(256, ge=1, description="seq-mean-token-sum-norm: the constant token normaliser.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    kl_coef: float = Field(
        0.05,
        ge=0.0,
        description="KL to the reference (iteration-0) policy; 0 = off. It keeps the tool-call format that "
        "long rollouts otherwise erode.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
    kl_in: Literal["loss", "reward"] = Field("loss", description="Put the KL penalty in the loss or the reward.")
    value_coef: float = Field(0.5, ge=0.0, description="Value-loss coefficient (critic estimators such as gae).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip range of the value loss (null = off).")
    recompute_old_logprobs: bool = Field(True, description="Old logprobs from a training forward pass (enables TIS).")
    tis_cap: float = Field(2.0, ge=1.0, description="Truncated importance sampling cap on pi_old / pi_generation.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping by global norm.")
    logprob_chunk_tokens: int = Field(1024, ge=1, description="Tokens per chunk of the vocabulary projection.")
    autocast: Literal["auto", "bf16", "off"] = Field("auto", description="bf16 autocast; auto = on CUDA only.")
    lora_rank: int = Field(0, ge=0, le=1024, description="Train LoRA adapters of this rank (0 = full fine-tune).")
    lora_alpha: float = Field(16.0, gt=0.0, description="LoRA alpha.")
    audit_rescore_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Audit: share of rollouts re-scored by the stored policy."
    )
    audit_tolerance: float = Field(1e-3, gt=0.0, description="Audit: max |stored - re-scored| logprob.")


class StoreConfig(Section):
    runs_dir: Path = Field(Path("runs"), description="Root of the versioned store.")


class RunnerConfig(Section):
    kind: Literal["thread", "ray"] = Field("thread", description="Where tools and rewards run.")
    max_workers: int = Field(8, ge=1, le=1024, description="Parallel tool calls.")
    ray_address: str | None = Field(None, description="Ray cluster address; empty means a local in-process Ray.")
    shards: int = Field(
        1, ge=1, le=4096, description="With ray: Ray tasks that share one execute-tools stage's rows (tool calls)."
    )


class RunConfig(Section):
    """Everything one training run needs. `mtrl run --help` lists the CLI flags that set it."""

    seed: int = Field(0, ge=0, description="Seed of task sampling, generation and training.")
    iterations: int = Field(10, ge=1, le=100_000, description="RL iterations (`mtrl run`).")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    generation: GenerationConfig = GenerationConfig()
    tools: ToolsConfig = ToolsConfig()
    reward: RewardConfig = RewardConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    ppo: PPOConfig = PPOConfig()
    store: StoreConfig = StoreConfig()
    runner: RunnerConfig = RunnerConfig()

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping of sections")
        return cls.model_validate(data)

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """A copy with dotted keys replaced, e.g. {"ppo.learning_rate": 1e-4}; validated."""
        data = self.model_dump(mode="json")
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for key in parents:
                if not isinstance(node.get(key), dict):
                    raise ValueError(f"unknown config section '{key}' in '{dotted}'")
                node = node[key]
            if leaf not in node:
                raise ValueError(f"unknown config field '{dotted}'")
            node[leaf] = value
        return RunConfig.model_validate(data)

    def pick(self, *paths: str) -> dict[str, Any]:
        """These fields as a JSON-normalised partial config (what a stage hashes into its
        version), e.g. pick("advantage", "ppo.kl_coef") -> {"advantage": {...}, "ppo": {"kl_coef": 0.05}}."""
        everything = self.model_dump(mode="json")
        picked: dict[str, Any] = {}
        for path in paths:
            *sections, field = path.split(".")
            source, target = everything, picked
            for name in sections:
                source, target = source[name], target.setdefault(name, {})
            target[field] = source[field]
        return picked
