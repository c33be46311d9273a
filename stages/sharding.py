"""Training on several processes: who this process is, and the few collective steps that
ppo_update needs to give the single-process result on N processes.

The update is data-parallel and FSDP2-sharded (torch.distributed.fsdp.fully_shard): every
rank holds 1/N of each parameter, gradient and AdamW moment, gathers a layer's full weights
only while it runs, and takes its share of every mini-batch. `Ranks` is the one object the
optimisation loop talks to; with world_size 1 (SINGLE) every step is the identity, so the
single-process update is the same code with no collectives.

Equal to one process, up to float rounding:
  - every rank sees the same mini-batches (the same shuffle seed) and takes sequences
    rank, rank + N, rank + 2N, ... of each (`share`);
  - the loss shares are normalised by the *global* mini-batch counts, so gradients must be
    summed across ranks, not averaged (`shard_model` sets FSDP's reduction to a plain sum);
  - every rank runs as many forward/backward passes as the busiest one (FSDP's collectives
    run in every pass): the others repeat a pass with weight 0 (`passes`);
  - the gradient norm is the global one (DTensor gradients: `grad_norm` gathers it);
  - metrics are summed across ranks (the *_max ones: maximum).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process among the training processes (rank 0 writes the results)."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, items: list[T]) -> list[T]:
        """This rank's items: every world_size-th one, starting at its rank (deterministic)."""
        return items[self.rank :: self.world_size]

    def max_count(self, count: int) -> int:
        """The largest `count` over the ranks."""
        if not self.distributed:
            return count
        value = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-rank metric sums -> global ones: summed, except names ending in _max (maximum).
        Every rank must hold the same names in the same order (the loop builds them so)."""
        if not self.distributed or not sums:
            return sums
        names = list(sums)
        maxima = [name for name in names if name.endswith("_max")]
        totals = [name for name in names if not name.endswith("_max")]
        out = dict(sums)
        for group, op in ((totals, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
            if group:
                values = torch.tensor([sums[name] for name in group], dtype=torch.float64)
                dist.all_reduce(values, op=op)
                out.update(zip(group, values.tolist()))
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of replicated (unsharded) parameters across ranks: the value head."""
        if not self.distributed:
            return
        for param in parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


SINGLE = Ranks()


def passes(items: list[T], ranks: Ranks, split: Callable[[list[T]], list[list[T]]]) -> list[tuple[list[T], float]]:
    """This rank's forward(/backward) passes over its share of `items`, each with its weight:
    split(share) at weight 1, then, up to the busiest rank's count, [items[0]] at weight 0
    (FSDP gathers every layer's weights in each pass, so every rank must run as many)."""
    share = ranks.share(items)
    own = split(share) if share else []
    return [(chunk, 1.0) for chunk in own] + [(items[:1], 0.0)] * (ranks.max_count(len(own)) - len(own))


# ---------------------------------------------------------------------------------------
# Under torchrun: the process group and the sharded model
# ---------------------------------------------------------------------------------------


def init_ranks(timeout_s: float) -> Ranks:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment): nccl with one GPU per process when CUDA is present, gloo on CPU. A
    collective that waits longer than timeout_s (a rank died) raises instead of hanging."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" now means this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size())


def shard_model(scorer: torch.nn.Module) -> None:
    """FSDP2 in place on a stages.policy.scoring.Scorer: each decoder layer is one unit (its weights are
    gathered while it runs, then freed), the rest (embeddings, final norm, output projection)
    the root unit, gathered by the Scorer's forward. Gradients are reduced by a plain sum:
    the loss shares are already normalised by the global mini-batch, so FSDP's default
    average would divide them by N once more."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in scorer.model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(scorer)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank must call it), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def like_parameter(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full tensor (a saved AdamW moment) laid out as `param`: this rank's shard of it when
    the parameter is sharded. Every rank read the same file, so no data moves."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = full.to(param.device, param.dtype)
        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device, param.dtype)


def grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients to the global L2 norm max_norm and return that norm (over every
    rank's shards when they are DTensors)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = full_tensor(torch.nn.utils.get_total_norm(grads))
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return float(total)
