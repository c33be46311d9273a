"""The one run configuration: a pydantic model with a section per part of the pipeline.

Loaded from YAML (`mtrl run --config FILE`), overridden by CLI flags, and used as the
Prefect flow's parameter schema. Every field has a type, a range, a description and a
default that works for the CPU demo. No stage reads this model or hashes this module: each stage
declares the fields it reads (its settings, schemas/stage.py) and its version hashes their values,
so a help text edited here versions nothing, and changing the estimator leaves rollouts cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.task_mix import parse_task_mix


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
        None, description="Local HF causal-LM directory, GGUF file or hub id; null means the embedded tiny model."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype for generation and evaluation (training and scoring use float32)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy runs; auto picks cuda if present."
    )
    chat_template: str | None = Field(
        None,
        description="A chat template that replaces the model's own when it is imported: hermes (the Hermes "
        "tool-calling template mtrl ships, for ChatML models whose template drops the tools, e.g. SmolLM2) or a "
        "Jinja file. null = the model's own; a template that renders the same prompt with and without the task's "
        "tools is refused at run start.",
    )


class TaskConfig(Section):
    name: str = Field(
        "calculator",
        description="Environment, or a weighted mix: 'calculator', 'calculator,guess-number', 'calculator:3,weather:1'.",
    )
    rollouts: int = Field(
        64, ge=1, le=100_000, description="Rollouts per iteration (tasks x group size); a multiple of group_size."
    )
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
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Settings of an ecosystem task, by task name (docs/environments.md): a reasoning-gym "
        "generator's options ({'reasoning-gym/chain_sum': {'min_terms': 2}}), a textarena game's arguments, an "
        "OpenEnv environment's class or URL. Part of the versions of the stages they shape. Each task named "
        "here is one of task.name's or sft.task's.",
    )
    tools: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The tools offered to a task, by task name, replacing its environment's own (registered "
        "tools, e.g. calculate and python, or tools of tools.mcp_servers): {'reasoning-gym/chain_sum': "
        "['calculate']}; [] offers none. Each task named here is one of task.name's or sft.task's.",
    )

    @model_validator(mode="after")
    def _groups_divide_rollouts(self) -> TaskConfig:
        if self.rollouts % self.group_size:
            raise ValueError(f"rollouts ({self.rollouts}) must be a multiple of group_size ({self.group_size})")
        parse_task_mix(self.name)  # raises on a malformed mix
        return self


class GenerationConfig(Section):
    engine: str = Field(
        "hf",
        description="Generation engine by name (stages/generate_rollouts/engine.py): hf = in-process Hugging Face "
        "model with per-rollout KV caches, the exact reference; vllm = a vLLM server (section vllm).",
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature; logprobs use the same.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(96, ge=1, le=65536, description="Most tokens generated in one assistant turn.")
    max_context_tokens: int = Field(
        4096, ge=16, description="Token budget of a whole rollout (prompt, turns, observations); beyond it: truncated."
    )
    enable_thinking: bool = Field(True, description="Chat template flag; false pre-fills an empty <think> block.")
    kept_kv_mb: float = Field(
        4096.0,
        ge=0.0,
        description="MB of KV cache the hf engine keeps for the rollouts between an agent's calls; past it the least "
        "recently used rollouts' are dropped and computed again at their next call (slower, the same bytes).",
    )

    @model_validator(mode="after")
    def _a_turn_fits_the_context(self) -> GenerationConfig:
        if self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be below max_context_tokens "
                f"({self.max_context_tokens}): one turn must fit a rollout's context with its prompt"
            )
        truncating = self.top_k > 0 or self.top_p < 1.0
        if self.engine == "vllm" and truncating and self.temperature != 1.0:
            # vLLM returns log_softmax(logits) (raw) or the log-probabilities after temperature AND
            # top-k/top-p (processed); the stored convention is after temperature, before truncation.
            raise ValueError(
                "engine vllm cannot return the stored logprob convention (after temperature, before top-k/top-p) "
                "when top-k/top-p are on and temperature != 1: turn top_k/top_p off or set temperature 1"
            )
        return self


class VLLMConfig(Section):
    """Where and how the vLLM server runs (generation.engine = vllm). Not hashed into versions:
    the sampled numbers depend on the policy, the sampling settings and vLLM's version (hashed),
    not on where the server runs."""

    python: str | None = Field(
        None,
        description="Python of the environment vLLM is installed in (its own: vLLM cannot share one with Prefect); "
        "null = .venv-vllm/bin/python of this checkout (built by `make setup`).",
    )
    url: str | None = Field(
        None,
        description="Base URL of a vLLM server you run (e.g. http://gpu-node:8000; started with VLLM_SERVER_DEV_MODE=1); "
        "null = mtrl starts one on 127.0.0.1 and stops it at exit.",
    )
    weight_update: Literal["in_place", "restart"] = Field(
        "in_place",
        description="How the server gets each iteration's policy: in_place = the running server reloads the "
        "checkpoint (a server mtrl starts: vLLM's reload plus mtrl's worker extension, exact on the CPU build too; "
        "a server at `url`: vLLM's reload_weights); restart = a new server on the checkpoint. Every update is "
        "verified against an HF float32 recompute of a probe before the server generates with it.",
    )
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="vLLM --tensor-parallel-size (GPUs per replica).")
    data_parallel_size: int = Field(1, ge=1, le=1024, description="vLLM --data-parallel-size (replicas).")
    gpu_memory_utilization: float = Field(
        0.15,
        gt=0.0,
        le=1.0,
        description="vLLM --gpu-memory-utilization: the share of GPU memory (on the CPU build: of host memory) vLLM "
        "reserves for weights and KV cache; leave room for training on the same device.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More `vllm serve` arguments, passed as they are (e.g. ['--max-num-seqs', '512']).",
    )
    start_timeout_s: float = Field(600.0, gt=0.0, description="Seconds a started server may take to become healthy.")
    request_timeout_s: float = Field(600.0, gt=0.0, description="Seconds one completion request may take.")

    @model_validator(mode="after")
    def _a_remote_server_is_reloaded(self) -> VLLMConfig:
        if self.url and self.weight_update == "restart":
            raise ValueError("vllm.url: mtrl cannot restart a server it did not start; use weight_update in_place")
        return self


class MCPServerConfig(Section):
    """A Model Context Protocol tool server: its tools are offered as tools of that name."""

    name: str = Field(description="A label for the server, used in messages and versions.")
    command: list[str] | None = Field(
        None,
        description="A stdio server: the command and its arguments (e.g. ['python', 'server.py']). mtrl starts it, "
        "one process per concurrent call, killed at a call's deadline and when mtrl exits.",
    )
    url: str | None = Field(None, description="A server you run, over streamable HTTP (e.g. http://host:8000/mcp).")
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of a stdio server, beside HOME, PATH, USER, ..."
    )
    start_timeout_s: float = Field(60.0, gt=0.0, description="Seconds a server may take to start and answer.")

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server '{self.name}': give exactly one of command (stdio) and url (HTTP)")
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server '{self.name}': command is empty")
        return self


class ToolsConfig(Section):
    timeout_s: float = Field(5.0, gt=0.0, le=3600.0, description="Wall-clock limit per tool call, in seconds.")
    max_output_chars: int = Field(
        2000, ge=16, description="Tool output beyond this many characters is truncated (and marked)."
    )
    sandbox: bool = Field(
        True,
        description="Run each call in its own worker process, killed at the timeout, with the memory limit; every "
        "tool must then be a module-level function of an importable module (checked at run start). false runs "
        "calls in threads: no kill, no memory limit.",
    )
    memory_mb: int = Field(512, ge=16, description="Memory a sandboxed tool call may add, in MB.")
    malformed_call: Literal["error", "answer"] = Field(
        "error",
        description="A turn with a tool call the parser cannot read (not JSON, no name, no closing tag): error = "
        "every call of the turn is answered (the unreadable one with its parse error) and the rollout goes on, so "
        "the model can correct itself; answer = no call runs and the turn is the final answer, as TRL's "
        "GRPOTrainer reads it (its parser falls back to plain text).",
    )
    mcp_servers: list[MCPServerConfig] = Field(
        default_factory=list,
        description="MCP tool servers started (command) or reached (url) at run start; their tools are offered to "
        "the tasks that name them (an environment's tools, or task.tools).",
    )

    @model_validator(mode="after")
    def _servers_have_distinct_names(self) -> ToolsConfig:
        names = [server.name for server in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"tools.mcp_servers: two servers share a name ({names})")
        return self


class AgentConfig(Section):
    """An agent program instead of the native turn loop (docs/agents.md): mtrl serves an
    OpenAI-compatible endpoint for the policy and records every call."""

    function: str | None = Field(
        None,
        description="MODULE:FUNCTION of an agent program (sync or async) called once per rollout with an "
        "AgentRollout (task, base_url, api_key, model, client); it returns the reward, or None for the task's "
        "reward of its final answer. null = the native loop.",
    )
    concurrency: int = Field(
        0,
        ge=0,
        description="Rollouts whose agents run at once (a sync agent each in a thread of its own), in each agents' "
        "process (with runner ray: each Ray task's); 0 = all of its rollouts.",
    )
    python: str | None = Field(
        None,
        description="The Python that runs the agents (a path, e.g. .venv-agent/bin/python, or a command on PATH): "
        "an environment of the agent's own, with its own pins; it needs only the agent's own packages. "
        "null = mtrl's own.",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Deadline of one rollout's agent, from when it starts (not while it waits for a slot): past it "
        "the rollout fails, the run goes on.",
    )
    max_calls: int | None = Field(
        None,
        ge=1,
        description="Model calls per rollout; null = the task's turn limit. The next call is refused "
        "and the rollout cut at the limit (max_turns).",
    )
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Where the agents run: local = one agents' process on this machine; ray = the rollouts split "
        "over ray_tasks Ray tasks on the nodes of the cluster at runner.ray_address that have ray_resources, each "
        "running its shard's agents in an agents' process on its node (docs/agents.md, Agents on other machines).",
    )
    host: str = Field(
        "127.0.0.1",
        description="The address the endpoint binds. 127.0.0.1 is reached from this machine only (with runner ray: "
        "nodes on other machines cannot reach it); 0.0.0.0 binds every interface, and the agents are given this "
        "node's address as Ray sees it. The run's key guards the endpoint.",
    )
    ray_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="With runner ray: the Ray resources each agents' task asks for, exactly (CPU, GPU and memory "
        "included: none unless named). A custom resource that only the agents' nodes have (ray start --resources "
        "'{\"agents\": 8}') pins the agents to those nodes.",
    )
    ray_tasks: int = Field(
        1,
        ge=1,
        le=4096,
        description="With runner ray: Ray tasks that share an iteration's rollouts, in contiguous shards, spread over "
        "the nodes with ray_resources; each runs its shard's agents in one agents' process (concurrency applies to "
        "each). A task whose worker dies fails only its shard's rollouts.",
    )

    @model_validator(mode="after")
    def _ray_resources_are_amounts(self) -> AgentConfig:
        negative = {name: amount for name, amount in self.ray_resources.items() if amount < 0}
        if negative:
            raise ValueError(f"agent.ray_resources: amounts cannot be negative: {negative}")
        return self


class RewardConfig(Section):
    truncated_reward: float = Field(
        0.0, ge=-1e6, le=1e6, description="Final reward of a rollout cut by its turn limit or the context budget."
    )
    overlong_reward: float = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="Final reward of a rollout whose turn ran past max_new_tokens without ending (0: no reward, "
        "as TRL scores a cut completion). A negative value is DAPO's overlong penalty (arXiv:2503.14476); at "
        "-0.5, the default until 2026-11-29, a group of failures with one cut rollout taught the others (SmolLM2: "
        "less held-out success on both seeds measured, docs/performance.md).",
    )


class AdvantageConfig(Section):
    estimator: str = Field(
        "grpo",
        description="Advantage estimator: grpo, rloo, reinforce++, reinforce++-baseline, gae (with a value head), "
        "or one a plugin registers.",
    )
    normalize_by_std: bool = Field(True, description="GRPO: divide by the group std (false = Dr. GRPO).")
    epsilon: float = Field(1e-6, gt=0.0, description="Added to a std before dividing by it.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount per assistant token (gae, reinforce++).")
    lam: float = Field(
        0.95, ge=0.0, le=1.0, description="GAE lambda: 0 = one-step TD error, 1 = Monte Carlo return minus value."
    )
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
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=0,
        description="Pack rollouts into forward/backward passes of at most this many tokens, no padding "
        "(0 = micro_batch_rollouts padded rollouts per pass). null = by the model's size and the device: 1024 "
        "from 50M parameters on the CPU, else 0 (the choice is in the ppo-update manifest).",
    )
    share_prefix: bool = Field(
        True,
        description="Compute the common prefix of rollouts in one pass once (a group's prompt, the system "
        "prompt and tools): every training and scoring pass (reference logprobs, values, old logprobs) lays "
        "them out as one prefix and each one's remainder under a shared-prefix attention mask, the same "
        "logprobs and gradients from fewer tokens. Models whose attention takes no custom mask (flash "
        "attention) or has sliding-window layers are scored unshared.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute layer activations in the backward pass (less memory, ~1/3 more compute). null = by "
        "the model's size: on from 50M parameters (a 135M model's update peaked at 11.7 GB without it).",
    )
    clip_low: float = Field(
        0.2, ge=0.0, le=1.0, description="PPO ratio clip below 1: ratios under 1 - clip_low are clipped (epsilon_low)."
    )
    clip_high: float = Field(
        0.28,
        ge=0.0,
        le=10.0,
        description="PPO ratio clip above 1: ratios over 1 + clip_high are clipped "
        "(epsilon_high; above clip_low = clip-higher).",
    )
    clip_ratio_c: float | None = Field(
        3.0, gt=1.0, description="Dual clip: with a negative advantage A the token loss is at most -c*A (null = off)."
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="How per-token losses become one number: the mean over all tokens, the mean of the rollouts' "
        "means, or the sum over tokens / (rollouts x loss_norm_tokens) (Dr. GRPO).",
    )
    loss_norm_tokens: int = Field(256, ge=1, description="seq-mean-token-sum-norm: the constant token normaliser.")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of the entropy bonus subtracted from the loss (0 = off)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="KL to the reference (iteration-0) policy; 0 = off, as in TRL's GRPOTrainer and the DAPO and "
        "Dr. GRPO recipes: the demo learned as well without it and skips the reference pass (docs/performance.md).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (Schulman's k1, k2, k3).")
    kl_in: Literal["loss", "reward"] = Field("loss", description="Put the KL penalty in the loss or the reward.")
    value_coef: float = Field(0.5, ge=0.0, description="Value-loss coefficient (critic estimators such as gae).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip range of the value loss (null = off).")
    recompute_old_logprobs: bool | None = Field(
        None,
        description="Old logprobs from a training forward pass (enables TIS); null = only when the stored generation "
        "logprobs are not already the policy's: they are with the hf engine in float32 (equal within 1e-5, tested; "
        "the audit re-scores a share of rollouts every iteration), so that pass is skipped.",
    )
    tis_cap: float = Field(2.0, ge=1.0, description="Truncated importance sampling cap on pi_old / pi_generation.")
    max_staleness: int = Field(
        0,
        ge=0,
        le=1000,
        description="Bounded staleness K: iteration i's rollouts are generated by the policy of iteration "
        "max(0, i - K) (a fixed schedule: the same versions on every run), so the next iteration generates while "
        "ppo-update trains. The update is decoupled PPO: the ratio against the policy it starts from (old logprobs "
        "recomputed), times the truncated importance weight (tis_cap) from the generating policy to it. 0 = "
        "generate, then train.",
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global L2 norm.")
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Tokens per chunk of the vocabulary projection (bounds the memory of the logits)."
    )
    autocast: Literal["auto", "bf16", "off"] = Field("auto", description="bf16 autocast; auto = on CUDA only.")
    lora_rank: int = Field(0, ge=0, le=1024, description="Train LoRA adapters of this rank (0 = full fine-tune).")
    lora_alpha: float = Field(16.0, gt=0.0, description="LoRA scale: adapter updates are multiplied by alpha / rank.")
    world_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="Training processes of ppo-update: >1 runs it under torchrun (on this machine, or on `nodes` "
        "nodes of a Ray cluster), the policy, its gradients and AdamW state sharded with FSDP2 (nccl, one GPU per "
        "process; gloo on CPU), each process taking its share of every mini-batch. The result equals one process "
        "up to float rounding, so the world size is part of the version. Not with lora_rank > 0.",
    )
    nodes: int = Field(
        1,
        ge=1,
        le=1024,
        description="Machines the world_size processes are spread over, world_size / nodes on each: 1 = torchrun on "
        "this machine; >1 = torchrun on that many distinct nodes of the Ray cluster at runner.ray_address (the runs "
        "directory and mtrl at the same paths on every node). Where the processes run, not what they compute: not "
        "part of the version.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description="With world_size > 1: a collective (gradient reduction, weight gathering) that waits longer "
        "than this fails the stage instead of hanging. When a hung job fails, not what a finished one computed: "
        "not part of the version.",
    )

    @model_validator(mode="after")
    def _sharding_supports_the_update(self) -> PPOConfig:
        if self.world_size > 1 and self.lora_rank > 0:
            raise ValueError(
                f"world_size={self.world_size} with lora_rank={self.lora_rank}: LoRA updates run in one process "
                "(set world_size=1, or lora_rank=0 for a sharded full fine-tune)"
            )
        if self.world_size % self.nodes:
            raise ValueError(
                f"world_size={self.world_size} over nodes={self.nodes}: every node runs the same number of "
                "processes, so nodes must divide world_size"
            )
        if self.max_staleness > 0 and self.recompute_old_logprobs is False:
            raise ValueError(
                f"max_staleness={self.max_staleness} with recompute_old_logprobs=false: stale rollouts' logprobs are "
                "another policy's, and the decoupled loss needs the trained policy's own (leave it null)"
            )
        return self


class SFTConfig(Section):
    """The warm start: supervised fine-tuning of the starting model on environment demonstrations
    (`mtrl sft`, and `mtrl run` before its first iteration). Its result is a stored policy; the RL
    stages see these fields only through that policy's version."""

    steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Optimiser steps of supervised fine-tuning on demonstrations before RL; 0 = no warm start "
        "(RL starts from the imported model).",
    )
    task: str | None = Field(
        None,
        description="Environment or weighted mix whose demonstrations are trained on (as task.name, e.g. "
        "'calculator:3,weather:1'); null = task.name. It may differ from the RL task.",
    )
    batch_size: int = Field(8, ge=1, le=65536, description="Demonstrations per optimiser step, freshly sampled.")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="AdamW learning rate (a fresh AdamW, not stored).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up from 0.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global L2 norm.")
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute layer activations in the backward pass (less memory, more compute); null = on from "
        "50M parameters, as ppo.gradient_checkpointing.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=0,
        description="Pack a step's demonstrations into forward/backward passes of at most this many tokens, no "
        "padding (0 = all of them in one padded pass). null = as ppo.max_tokens_per_micro_batch: 1024 from "
        "50M parameters on the CPU, else 0.",
    )
    share_prefix: bool = Field(
        True, description="Compute the demonstrations' common prefix (system prompt, tools) once, as ppo.share_prefix."
    )

    @model_validator(mode="after")
    def _a_valid_task_mix(self) -> SFTConfig:
        if self.task is not None:
            parse_task_mix(self.task)  # raises on a malformed mix
        return self


class AuditConfig(Section):
    """The checks a compute-advantages version passes before ppo-update trains on it (pipeline/store/audit.py).
    They decide whether the update runs, not what it computes: no version hashes them."""

    rescore_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Share of rollouts re-scored by the stored policy."
    )
    tolerance: float | None = Field(
        None,
        gt=0.0,
        description="Max |stored - re-scored| logprob; null = by model.dtype (float32 1e-3, float16 0.05, "
        "bfloat16 0.5: the re-score is float32, low-precision generation differs by rounding).",
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the iteration, writing no policy, when more than this share of its rollouts failed "
        "(tools crashed, environments raised): a run where everything fails must not look like success.",
    )


class StoreConfig(Section):
    """Where versions are stored and how long a policy's AdamW state is kept (retention). No stage
    hashes these fields: retention deletes only what continuing training needs, never data, and
    the fresh AdamW that fresh_optimizer_if_pruned lets ppo-update start is hashed into that
    update's version (its setting fresh_optimizer), where it takes effect."""

    runs_dir: Path = Field(Path("runs"), description="Root of the versioned store.")
    keep_optimizer_state: int = Field(
        2,
        ge=1,
        description="After each ppo-update, the newest N policies of the new policy's lineage keep their AdamW state "
        "(optimizer.safetensors, twice the size of fp32 weights); older ones lose it and keep weights, tokenizer, "
        "value head and manifest. 2: the newest, which the next iteration continues, and the one before, which "
        "re-running or rebuilding the newest update continues. Part of no version.",
    )
    fresh_optimizer_if_pruned: bool = Field(
        False,
        description="A ppo-update that would continue an AdamW state that retention pruned (training an older "
        "policy again) fails, naming the policy; true trains it with a fresh AdamW instead, as a new ppo-update "
        "version that records it (its setting fresh_optimizer). An update already stored is reused either way.",
    )


class RunnerConfig(Section):
    kind: Literal["thread", "ray"] = Field("thread", description="Where tools and rewards run.")
    max_workers: int = Field(8, ge=1, le=1024, description="Rollouts whose tool calls run at the same time.")
    ray_address: str | None = Field(
        None,
        description="Ray cluster address (the ray runner's tasks; ppo-update with ppo.nodes > 1); null means a local "
        "in-process Ray.",
    )
    shards: int = Field(
        1, ge=1, le=4096, description="With ray: Ray tasks that share one execute-tools stage's rows (tool calls)."
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads of each process mtrl runs (generation and training here, torchrun ranks share "
        "it, tool workers, Ray workers, vLLM and Prefect servers); null = OMP_NUM_THREADS when mtrl was started "
        "with it, else every core while stages run one at a time and half of them with ppo.max_staleness > 0 (two "
        "stages compute at once). Set it (or OMP_NUM_THREADS) where other work shares the cores. Where the work "
        "runs, not what it computes: not part of any version (float sums may round differently with another "
        "count, as on another CPU).",
    )


TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]


class TrackingConfig(Section):
    """Experiment trackers that each iteration's metrics, stage times, data counts and a few sample
    trajectories are copied to (pipeline/monitoring/tracking.py, docs/tracking.md). The store stays the record:
    no stage reads these fields, so they are part of no version, and a tracker that fails warns once
    and the run goes on without it."""

    backends: list[TrackerName] = Field(
        default_factory=list,
        description="Trackers to log to: any of tensorboard, mlflow, wandb, trackio (the `tracking` extra installs "
        "them). [] = none: nothing is logged and no tracker library is imported.",
    )
    project: str = Field(
        "mtrl", min_length=1, description="Project (MLflow: experiment) the tracker run is filed under."
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking server URL (e.g. http://mlflow-host:5000); null = a local SQLite store, "
        "mlflow.db in tracking.dir.",
    )
    dir: Path | None = Field(
        None,
        description="Where the trackers' local files go (TensorBoard events, W&B run files, the trackio and MLflow "
        "stores) and the record of what each tracker logged (what a resumed run continues); null = "
        "<store.runs_dir>/tracking.",
    )
    trajectories: int = Field(
        4, ge=0, le=1000, description="Sample rollouts per iteration in the trajectory table; 0 = no table."
    )
    timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="Longest wait for the trackers after an iteration (and at exit); a tracker that has not "
        "answered by then, or failed, warns once and is not used again by this process.",
    )

    @model_validator(mode="after")
    def _each_backend_once(self) -> TrackingConfig:
        if len(set(self.backends)) < len(self.backends):
            raise ValueError(f"tracking.backends lists a tracker twice: {self.backends}")
        return self


class RunConfig(Section):
    """Everything one training run needs: `mtrl run --help` lists its CLI flags, `mtrl config` every field."""

    seed: int = Field(0, ge=0, description="Seed of task sampling, generation and training.")
    iterations: int = Field(10, ge=1, le=100_000, description="RL iterations (`mtrl run`).")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    generation: GenerationConfig = GenerationConfig()
    vllm: VLLMConfig = VLLMConfig()
    tools: ToolsConfig = ToolsConfig()
    reward: RewardConfig = RewardConfig()
    agent: AgentConfig = AgentConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    ppo: PPOConfig = PPOConfig()
    sft: SFTConfig = SFTConfig()
    audit: AuditConfig = AuditConfig()
    store: StoreConfig = StoreConfig()
    runner: RunnerConfig = RunnerConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _agents_on_ray_have_a_cluster(self) -> RunConfig:
        if self.agent.runner == "ray" and not self.runner.ray_address:
            raise ValueError(
                "agent.runner ray runs the agents on the nodes of a Ray cluster: set runner.ray_address (e.g. auto on "
                "a node of a cluster started with `ray start`, or HEAD_IP:6379)"
            )
        return self

    @model_validator(mode="after")
    def _training_nodes_have_a_cluster(self) -> RunConfig:
        if self.ppo.nodes > 1 and not self.runner.ray_address:
            raise ValueError(
                f"ppo.nodes={self.ppo.nodes} runs ppo-update on the nodes of a Ray cluster: set runner.ray_address "
                "(e.g. auto on a node of a cluster started with `ray start`, or HEAD_IP:6379)"
            )
        return self

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

    def stages_overlap(self) -> bool:
        """Do two stages compute at once? With ppo.max_staleness > 0 the next iteration's batch
        generates while ppo-update trains (the thread default halves the cores then)."""
        return self.ppo.max_staleness > 0
