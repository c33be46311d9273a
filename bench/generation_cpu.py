"""Generation throughput of the rollout engine on CPU, with and without KV reuse across turns.

    python bench/generation_cpu.py [--rollouts 32] [--turns 3] [--out bench/results/generation_cpu.json]

Both paths run the same multi-turn calculator rollouts (same seeds, same tokens): "kv_reuse"
is mtrl's engine (a new turn prefills only its delta tokens); "re_encode" resets the cache
before every turn, as a notebook loop that re-encodes the whole history does. Only time spent
inside HFEngine.sample is counted (tools and dataset building are excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import torch

from pipeline.evaluate import run_episodes
from pipeline.models import EMBEDDED_POLICY
from schemas.config import RunConfig
from stages.generate_rollouts.hf import HFEngine
from stages.policy import eos_token_ids, load_model, load_tokenizer


class TimedEngine(HFEngine):
    def __init__(self, *args, re_encode: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.re_encode, self.seconds, self.tokens = re_encode, 0.0, 0

    def sample(self, requests, sampling, forced=None, report_progress=None):
        if self.re_encode:
            self.reset()
        started = time.perf_counter()
        completions = super().sample(requests, sampling, forced, report_progress)
        self.seconds += time.perf_counter() - started
        self.tokens += sum(len(c.token_ids) for c in completions)
        return completions


def measure(re_encode: bool, config: RunConfig, repeats: int) -> dict[str, float]:
    model, tokenizer = load_model(EMBEDDED_POLICY, "float32", "cpu"), load_tokenizer(EMBEDDED_POLICY)
    engine = TimedEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), re_encode=re_encode)
    turns = None
    for iteration in range(repeats):
        turns = run_episodes(engine, tokenizer, config, iteration=iteration)
    return {
        "generated_tokens": engine.tokens,
        "generate_seconds": round(engine.seconds, 3),
        "tokens_per_second": round(engine.tokens / engine.seconds, 1),
        "rows_last_repeat": len(turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "generation_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = RunConfig(task={"rollouts": args.rollouts, "group_size": 8, "max_turns": args.turns})
    results = {"kv_reuse": measure(False, config, args.repeats), "re_encode": measure(True, config, args.repeats)}
    results["speedup_kv_reuse"] = round(
        results["kv_reuse"]["tokens_per_second"] / results["re_encode"]["tokens_per_second"], 2
    )
    report = {
        "benchmark": "generation_cpu",
        "command": f"python bench/generation_cpu.py --rollouts {args.rollouts} --turns {args.turns} "
        f"--repeats {args.repeats} --threads {args.threads}",
        "model": "embedded tiny Qwen3 (pipeline/embedded/policy), fp32",
        "workload": {"task": "calculator", "rollouts": args.rollouts, "max_turns": args.turns, "repeats": args.repeats},
        "results": results,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads, "platform": platform.platform()},
        "versions": {name: metadata.version(name) for name in ("torch", "transformers", "datasets")}
        | {"python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
