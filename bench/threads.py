"""What thread count should each mtrl process use? runner.threads = 1 against 2 on this machine,
quiet and with one core kept busy by another process (a second job on the machine), in one
invocation:

    python bench/threads.py [--gguf FILE] [--out bench/results/threads_cpu.json]

Each measurement is a whole command: `mtrl eval` (generation and tools) of the starting model on
fixed calculator tasks, the embedded tiny model (64 rollouts) and SmolLM2-135M-Instruct (8
rollouts, the Hermes template, thinking off; its GGUF as bench/real_model.py finds it); and the
demo, `mtrl run` (10 iterations, every stage), in a fresh runs directory each time.
Runs alternate between the settings so that drift in the machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learning import mtrl  # noqa: E402
from provenance import machine  # noqa: E402
from real_model import gguf_path  # noqa: E402

REPEATS = 1  # runs per setting and load; raise it for medians


def spin() -> None:
    while True:
        pass


def seconds(command: list[str], threads: int, runs_dir: Path) -> float:
    """Wall seconds of `mtrl COMMAND` with this thread count; `mtrl run` in a fresh runs dir (no cache hits)."""
    if command[0] == "run":
        runs_dir = Path(tempfile.mkdtemp(prefix="mtrl-threads-run-")) / "runs"
    _, wall = mtrl(*command, "--runs-dir", str(runs_dir), "--set", f"runner.threads={threads}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="SmolLM2's GGUF file (default: as bench/real_model.py finds it)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "threads_cpu.json")
    args = parser.parse_args()
    models = {
        "embedded-0.88M": ["eval", "--task", "calculator", "--rollouts", "64", "--group-size", "1"],
        "smollm2-135m": [
            *("eval", "--model", str(gguf_path(args.gguf)), "--task", "calculator"),
            *("--rollouts", "8", "--group-size", "1"),
            *("--set", "model.chat_template=hermes", "--set", "generation.enable_thinking=false"),
        ],
        "the demo (mtrl run)": ["run"],
    }
    runs_dir = Path(tempfile.mkdtemp(prefix="mtrl-threads-")) / "runs"
    for flags in list(models.values())[:2]:  # import (and convert) each model once, outside the timings
        seconds([*flags, "--rollouts", "1", "--group-size", "1"], 1, runs_dir)
    results = []
    for load in ("quiet", "one core busy"):
        hog = multiprocessing.Process(target=spin, daemon=True) if load != "quiet" else None
        if hog is not None:
            hog.start()
        try:
            for model, flags in models.items():
                walls: dict[int, list[float]] = {1: [], 2: []}
                for _ in range(REPEATS):
                    for threads in (1, 2):
                        walls[threads].append(seconds(flags, threads, runs_dir))
                row = {"model": model, "load": load}
                row |= {f"threads_{t}_s": round(statistics.median(s), 1) for t, s in walls.items()}
                row["all_s"] = {t: [round(x, 1) for x in s] for t, s in walls.items()}
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            if hog is not None:
                hog.terminate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "repeats": REPEATS, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
