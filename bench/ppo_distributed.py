"""ppo-update on one process and on two (ppo.world_size = 2, FSDP2 under torchrun): speed and
peak memory per rank, through the stage's own launcher (runtime.launch.run_on_ranks with the
request of stages.ppo_update.worker.write_request, the worker stages.ppo_update.worker, as
stages.ppo_update.train_on_ranks runs them), so both world sizes run the same code path.

    python bench/ppo_distributed.py --out bench/results/ppo_distributed_cpu.json

The model is a random Qwen3 (--hidden, --layers; the embedded tokenizer's 741-token vocabulary)
big enough that its weights, gradients and AdamW moments (16 bytes a parameter) dominate a
rank's memory, trained on synthetic one-turn rollouts (bench/engine.py's synthetic_turns).
Reported per world size: completion tokens optimised per second of train_policy (load,
old-logprob recompute, update, gathering the result; not the processes' start-up), the
torch threads of each rank (torchrun gives each of several processes one thread), and each
rank's peak RSS (runtime.memory; on CUDA also the allocator's peak) twice: up to the last
optimiser step (update_peak_rss_mb) and in all (peak_rss_mb), which on rank 0 includes
gathering the whole checkpoint and AdamW state to write them; *_above_start_mb subtract the
RSS when train_policy began (the interpreter and its libraries).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/engine.py, beside this file
from engine import synthetic_turns  # noqa: E402

from pipeline.models.base_model import EMBEDDED_POLICY  # noqa: E402
from runtime.launch import Placement, run_on_ranks  # noqa: E402
from schemas.config import RunConfig  # noqa: E402
from stages.policy.loading import load_tokenizer  # noqa: E402
from stages.ppo_update import PPOSettings, TrainedOnRanks, worker  # noqa: E402


def random_policy(directory: Path, hidden: int, layers: int) -> int:
    """A random Qwen3 with the embedded tokenizer, saved as a policy folder; returns its parameters."""
    tokenizer = load_tokenizer(EMBEDDED_POLICY)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def measure(world_size: int, args: argparse.Namespace, folder: Path, turns_dir: Path, policy_dir: Path) -> dict:
    config = RunConfig(
        ppo={
            "world_size": world_size,
            "minibatch_rollouts": args.rollouts,
            "micro_batch_rollouts": args.micro_batch,
            "epochs": args.epochs,
            "kl_coef": 0.0,
        },
        model={"device": args.device},
    )
    settings = PPOSettings.resolve(config)
    lines: list[str] = []
    work = folder / f"work-{world_size}"
    work.mkdir(parents=True)
    request = worker.write_request(
        work, turns_dir=turns_dir, policy_dir=policy_dir, settings=settings, train_critic=False, seed=0
    )
    placement = Placement(settings.world_size, settings.nodes, settings.ray_address, settings.requested_device)
    run_on_ranks(worker.MODULE, request, placement, lines.append)
    trained = TrainedOnRanks(work / worker.POLICY_FILES, **json.loads((work / worker.RESULT).read_text()))
    tokens = sum(row["tokens"] for row in trained.metrics)
    ranks = [
        {
            **memory,
            "update_peak_above_start_mb": round(memory["update_peak_rss_mb"] - memory["rss_before_mb"], 1),
            "peak_above_start_mb": round(memory["peak_rss_mb"] - memory["rss_before_mb"], 1),
        }
        for memory in trained.memory_per_rank
    ]
    return {
        "world_size": world_size,
        "optimizer_steps": len(trained.metrics),
        "tokens": tokens,
        "train_s": trained.train_s,
        "tokens_per_s": round(tokens / trained.train_s, 1),
        "memory_per_rank": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256, help="tokens per rollout (a 64-token prompt)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=2, help="each world size this many times, interleaved")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ppo_distributed_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        parameters = random_policy(folder / "policy", args.hidden, args.layers)
        synthetic_turns(args.rollouts, args.seq, 741, ragged=False).save_to_disk(str(folder / "turns"))
        runs = [
            {
                "repeat": repeat,
                **measure(int(n), args, folder / f"repeat-{repeat}", folder / "turns", folder / "policy"),
            }
            for repeat in range(args.repeats)  # interleaved: the 2 cores are shared, so load drifts over minutes
            for n in args.world_sizes.split(",")
        ]
    result = {
        "what": "ppo-update, one process against FSDP2 on several (torchrun, gloo on CPU)",
        "model": {"parameters": parameters, "hidden": args.hidden, "layers": args.layers, "dtype": "float32"},
        "workload": {"rollouts": args.rollouts, "tokens_per_rollout": args.seq, "micro_batch": args.micro_batch},
        "runs": runs,
        "machine": {
            "cpu_count": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": metadata.version("torch"),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
