"""ppo-update on several processes: launch and supervise a torchrun job (ppo.world_size > 1).

The ppo-update task calls `train_with_torchrun` instead of training in its own process:

  1. it writes WORK/request.json (the audited compute-advantages folder, the policy folder,
     the config, the seed) into a hidden folder of the store, removed afterwards (or by the
     store's clean-up of stale temporary folders if this process dies);
  2. it runs `torchrun --nproc-per-node N ... -m pipeline.ppo_worker WORK/request.json` on
     this machine (--max-restarts 0: a failed rank fails the job, it is not retried), streams
     every line of the ranks' output (prefixed [default<rank>]) to `log`, and turns rank 0's
     progress lines into `report_progress` calls;
  3. a non-zero exit raises TrainingProcessError naming the rank that failed first (torchrun's
     "Root Cause") and its exit code or signal; a rank that dies never leaves the others
     hanging: torchrun stops the others, and a collective waits at most
     ppo.collective_timeout_s;
  4. on success it returns what rank 0 wrote (the next policy's files, the metrics rows),
     which the task publishes through store.write as in the single-process case.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import ppo_worker
from pipeline.prefect_env import free_port
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent  # the repository the workers must import, as this process does
LAST_LINES = 30  # of torchrun's own output and of each rank's, kept to quote in a failure
RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")  # torchrun --tee: "[default<local rank>]:" before each line
PROGRESS_LINE = re.compile(rf"{ppo_worker.PROGRESS} ([0-9]+\.[0-9]+)")


class TrainingProcessError(RuntimeError):
    """A training process exited with an error; the message names its rank."""


@dataclass
class TrainedOnRanks:
    """What rank 0 of the job wrote: the next policy's files and the metrics rows."""

    files: Path
    metrics: list[dict[str, float]]
    optimizer_state_restored: int
    memory_per_rank: list[dict[str, Any]]
    train_s: float  # train_policy's wall time on rank 0 (without the processes' start-up)

    def save(self, directory: Path) -> dict[str, Any]:
        """Move the files into the store's temporary folder (same filesystem: a rename)."""
        for path in sorted(self.files.iterdir()):
            shutil.move(path, directory / path.name)
        return {}


def torchrun_command(world_size: int, request: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world_size}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",  # a failed rank fails the stage: a retry would train on from a half-done state
        "--tee=3",  # prefix each line with its rank, [default0]: ...
        f"--log-dir={request.parent / 'logs'}",
        "-m",
        "pipeline.ppo_worker",
        str(request),
    ]


def check_devices(config: RunConfig) -> None:
    """One GPU per process on CUDA: fail before launching when there are fewer."""
    import torch

    cuda = config.model.device == "cuda" or (config.model.device == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() < config.ppo.world_size:
        raise TrainingProcessError(
            f"ppo.world_size={config.ppo.world_size} needs one GPU per process; "
            f"this machine has {torch.cuda.device_count()}"
        )


def failure_message(returncode: int, world_size: int, tails: dict[str, deque[str]]) -> str:
    """Which rank failed first and how, from torchrun's "Root Cause" report, with that rank's
    last lines of output (its traceback) and torchrun's."""
    report = "\n".join(tails["torchrun"])
    root = report[report.find("Root Cause") :] if "Root Cause" in report else ""
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    who = f"rank {rank.group(1)} of {world_size}" if rank else f"a rank of {world_size} (torchrun exit {returncode})"
    how = ""
    if code:
        value = int(code.group(1))
        how = f" (killed by {signal.Signals(-value).name})" if value < 0 else f" (exit code {value})"
    own = "\n".join(tails.get(rank.group(1), [])) if rank else ""
    return (
        f"ppo-update failed: training process {who} died{how}; no policy was written.\n"
        f"Its last lines:\n{own}\ntorchrun:\n{report}"
    )


def train_with_torchrun(
    config: RunConfig,
    *,
    turns_dir: Path,
    policy_dir: Path,
    train_critic: bool,
    seed: int,
    work: Path,
    log: Callable[[str], None],
    report_progress: Callable[[float], None] | None = None,
) -> TrainedOnRanks:
    """Run the ppo-update as config.ppo.world_size processes; returns rank 0's results from `work`."""
    check_devices(config)
    work.mkdir(parents=True)
    request = work / ppo_worker.REQUEST
    payload = {
        "turns": str(turns_dir),
        "policy_dir": str(policy_dir),
        "config": config.model_dump(mode="json"),
        "train_critic": train_critic,
        "seed": seed,
    }
    request.write_text(json.dumps(payload))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    tails: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=LAST_LINES))  # "torchrun", "0", "1", ...
    command = torchrun_command(config.ppo.world_size, request)
    log(f"ppo-update on {config.ppo.world_size} processes: {' '.join(command)}")
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        for line in job.stdout:
            line = line.rstrip("\n")
            rank = RANK_PREFIX.match(line)
            text = line[rank.end() :] if rank else line
            progress = PROGRESS_LINE.fullmatch(text) if rank else None
            if progress:
                if report_progress is not None:
                    report_progress(float(progress.group(1)))
                continue
            tails[rank.group(1) if rank else "torchrun"].append(text)
            log(line)  # any other line, and a progress line that torchrun's tee glued to the next one
        returncode = job.wait()
    finally:
        if job.poll() is None:  # this process was interrupted: stop the job with it
            job.terminate()
            job.wait()
    if returncode != 0:
        raise TrainingProcessError(failure_message(returncode, config.ppo.world_size, tails))
    result = json.loads((work / ppo_worker.RESULT).read_text())
    return TrainedOnRanks(work / ppo_worker.POLICY_FILES, **result)
