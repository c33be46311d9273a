"""One training process of a ppo-update on several processes (ppo.world_size > 1).

The ppo-update stage starts world_size of them with torchrun (runtime/launch.py), on this machine or
on ppo.nodes nodes of a Ray cluster (one torchrun per node):

    torchrun --nnodes K --nproc-per-node N/K --rdzv-backend c10d --rdzv-endpoint HOST:PORT ... \\
        -m stages.ppo_update.worker WORK/request.json

request.json (write_request) names the compute-advantages dataset (a folder of the store, audited and
digest-checked by the stage), the policy folder to train, ppo-update's settings and the seed. Every
rank trains its share with stages.ppo_update.train.train_policy; rank 0 then writes the next
policy's files into WORK/policy/ and WORK/result.json (the metrics rows, how much AdamW
state continued, every rank's peak memory, the training time). The stage publishes them through the store, so
the write stays atomic and digested; nothing here touches the store.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import torch
import torch.distributed as dist

from runtime.launch import PROGRESS
from runtime.memory import peak_memory
from runtime.passes import counting_passes
from stages.ppo_update.train import PPOSettings, train_policy
from stages.sharding import init_ranks

MODULE = "stages.ppo_update.worker"  # what each rank runs: python -m MODULE WORK/request.json
REQUEST, RESULT, POLICY_FILES = "request.json", "result.json", "policy"


def write_request(
    work: Path, *, turns_dir: Path, policy_dir: Path, settings: PPOSettings, train_critic: bool, seed: int
) -> Path:
    """WORK/request.json: what every rank of the job trains on and how (read back by main)."""
    request = work / REQUEST
    payload = {
        "turns": str(turns_dir),
        "policy_dir": str(policy_dir),
        "settings": json.loads(settings.to_json()),
        "train_critic": train_critic,
        "seed": seed,
    }
    request.write_text(json.dumps(payload))
    return request


def progress_reporter(rank: int, memory: dict[str, float]) -> Callable[[float], None]:
    """After each optimiser step: rank 0 prints the share done; every rank notes its peak
    memory so far (the update's peak, before rank 0 gathers the whole policy to write it)."""

    def report(done: float) -> None:
        memory["update_peak_rss_mb"] = memory.get("peak_rss_mb", 0.0)
        if torch.cuda.is_available():
            memory["update_cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        if rank == 0:
            print(f"{PROGRESS} {done:.6f}", flush=True)

    return report


def main(request_path: str) -> None:
    work = Path(request_path).parent
    request = json.loads(Path(request_path).read_text())
    settings = PPOSettings.model_validate(request["settings"])
    ranks = init_ranks(settings.collective_timeout_s)
    # the processes of the job, for ps or kill (the tests find them so)
    print(f"rank {ranks.rank} of {ranks.world_size}: pid {os.getpid()}, torchrun pid {os.getppid()}", flush=True)
    turns = datasets.load_from_disk(request["turns"])
    started = time.perf_counter()
    with peak_memory() as memory, counting_passes() as passes:
        trained = train_policy(
            turns,
            request["policy_dir"],
            settings,
            train_critic=request["train_critic"],
            seed=request["seed"],
            report_progress=progress_reporter(ranks.rank, memory),
            ranks=ranks,
        )
    train_s = time.perf_counter() - started  # load, old logprobs, update, gather (not the start-up)
    memory_per_rank = ranks.gather({**memory, "torch_threads": torch.get_num_threads(), "passes": passes})
    if trained is not None:  # rank 0
        trained.save(work / POLICY_FILES)
        result = {
            "metrics": trained.metrics,
            "optimizer_state_restored": trained.optimizer_state_restored,
            "memory_per_rank": memory_per_rank,
            "train_s": round(train_s, 3),
        }
        (work / RESULT).write_text(json.dumps(result))
    dist.barrier()  # no rank leaves before the files are written (the job ends with its last rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
