"""A trained policy as ppo-update writes it and the next ppo-update continues it: the checkpoint,
its tokenizer, the value head and the AdamW state, as whole tensors keyed by parameter name
(safetensors, never pickle), so that any world size restores it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stages.policy.loading import ValueHead
from stages.sharding import full_tensor, like_parameter

OPTIMIZER_FILE = "optimizer.safetensors"


def _named_trainable(model: torch.nn.Module, value_head: ValueHead | None) -> dict[str, torch.nn.Parameter]:
    named = {f"policy.{n}": p for n, p in model.named_parameters() if p.requires_grad}
    if value_head is not None:
        named |= {f"critic.{n}": p for n, p in value_head.named_parameters()}
    return named


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, value_head: ValueHead | None, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Adam's moments and step count per named parameter, whole and on the CPU: the form
    that any world size restores. Sharded moments are gathered one at a time (every rank
    must call this; the ranks that do not write pass keep=False and get nothing back)."""
    tensors = {}
    for name, param in _named_trainable(model, value_head).items():
        for key, value in optimizer.state.get(param, {}).items():  # step, exp_avg, exp_avg_sq
            whole = full_tensor(value).detach()
            if keep:
                tensors[f"{name}/{key}"] = whole.cpu().contiguous()
    return tensors


def save_optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, value_head: ValueHead | None, directory: str | Path
) -> None:
    """optimizer_tensors as safetensors beside the policy (never pickle), so the next
    iteration's update continues the same optimiser."""
    save_file(optimizer_tensors(optimizer, model, value_head), Path(directory) / OPTIMIZER_FILE)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, value_head: ValueHead | None, directory: str | Path
) -> int:
    """Restore what save_optimizer_state wrote beside a policy; returns how many parameters
    got their state back (0 without a file: a fresh optimiser). A parameter without saved
    state (a critic added later) starts fresh; a shape that does not match is an error.
    The file holds whole tensors: a sharded parameter (FSDP2) gets this rank's shard."""
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        return 0
    saved: dict[str, dict[str, torch.Tensor]] = {}  # parameter name -> {step, exp_avg, exp_avg_sq}
    for key, value in load_file(path).items():
        name, _, field = key.rpartition("/")
        saved.setdefault(name, {})[field] = value
    restored = 0
    for name, param in _named_trainable(model, value_head).items():
        state = saved.get(name)
        if not state:
            continue
        for key, value in state.items():
            if key != "step" and value.shape != param.shape:
                raise ValueError(
                    f"{path}: state '{name}/{key}' has shape {tuple(value.shape)}, not {tuple(param.shape)}"
                )
        # Adam keeps `step` on the CPU (non-capturable); the moments live with the parameter.
        optimizer.state[param] = {k: v if k == "step" else like_parameter(v, param) for k, v in state.items()}
        restored += 1
    return restored


def save_policy(
    directory: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    value_head: ValueHead | None = None,
    optimizer_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Everything the next iteration loads: the checkpoint, its tokenizer and, when trained
    with them, the value head and the AdamW state (optimizer_tensors)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if value_head is not None:
        value_head.save(directory)
    if optimizer_state is not None:
        save_file(optimizer_state, Path(directory) / OPTIMIZER_FILE)
