"""One training process of a ppo-update on several processes (ppo.world_size > 1).

pipeline/launch.py starts world_size of them with torchrun, on this machine or on ppo.nodes nodes of
a Ray cluster (one torchrun per node):

    torchrun --nnodes K --nproc-per-node N/K --rdzv-backend c10d --rdzv-endpoint HOST:PORT ... \\
        -m stages.ppo_update.worker WORK/request.json

request.json (write_request) names the compute-advantages dataset (a folder of the store, audited and
digest-checked by the task), the policy folder to train, the run config and the seed. Every
rank trains its share with stages.ppo_update.train_policy; rank 0 then writes the next
policy's files into WORK/policy/ and WORK/result.json (the metrics rows, how much AdamW
state continued, every rank's peak memory, the training time). The task publishes them through the store, so
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

from runtime.memory import peak_memory
from schemas.config import RunConfig
from stages.policy import counting_passes
from stages.ppo_update import train_policy
from stages.sharding import init_ranks

PROGRESS = "mtrl-progress"  # rank 0 prints "mtrl-progress 0.25" after each optimiser step (share done)
REQUEST, RESULT, POLICY_FILES = "request.json", "result.json", "policy"


def write_request(
    work: Path, *, turns_dir: Path, policy_dir: Path, config: RunConfig, train_critic: bool, seed: int
) -> Path:
    """WORK/request.json: what every rank of the job trains on and how (read back by main)."""
    request = work / REQUEST
    payload = {
        "turns": str(turns_dir),
        "policy_dir": str(policy_dir),
        "config": config.model_dump(mode="json"),
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
    config = RunConfig.model_validate(request["config"])
    ranks = init_ranks(config.ppo.collective_timeout_s)
    # the processes of the job, for ps or kill (the tests find them so)
    print(f"rank {ranks.rank} of {ranks.world_size}: pid {os.getpid()}, torchrun pid {os.getppid()}", flush=True)
    turns = datasets.load_from_disk(request["turns"])
    started = time.perf_counter()
    with peak_memory() as memory, counting_passes() as passes:
        trained = train_policy(
            turns,
            request["policy_dir"],
            config=config.ppo,
            train_critic=request["train_critic"],
            temperature=config.generation.temperature,
            seed=request["seed"],
            device=config.model.device,
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
