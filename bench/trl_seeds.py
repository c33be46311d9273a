"""The SmolLM2 race of bench/trl_peer.py over several seeds, and what the seeds say together.

    pip install 'mtrl[bench]'
    python bench/trl_seeds.py [--seeds 0,1,2] [--held-out 256] [--iterations 4] [--out FILE]

One race is deterministic: the same seed gives the same tokens and the same curves again, so one
seed gives one draw of "does mtrl learn as well as TRL", and only more seeds tell a gap from the
seed's luck. Each seed is one invocation of `bench/trl_peer.py --model smollm2 --seed S` (its own
warm start, then TRL, then mtrl, then `mtrl eval` of the warm start and of both trained policies on
the same --held-out fixed tasks, sampled and greedy), written to its own file beside --out
(FILE_seed<S>.json). A seed whose file exists is read, not run again: a race takes about 80 minutes
on 2 cores (most of it TRL's training and the six evaluations), so the seeds can be run over several
sittings. After a change to mtrl, --trl-from EARLIER (an earlier --out) re-runs only mtrl's side of
each seed that EARLIER holds, taking TRL's side and the warm start's scores from it (about 30 minutes
a seed; `bench/trl_peer.py --trl-from`).

Written to --out (default: trl_peer_smollm2_seeds.json in bench/results): every seed's numbers, and over
the seeds each one's mean with its standard error (sample standard deviation / sqrt(seeds)) and the
paired difference mtrl - TRL (per seed, then mean and standard error), which removes what a seed
does to both sides alike (its warm start, its tasks).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orchestration import REPO  # noqa: E402
from provenance import machine  # noqa: E402

SIDES = ("trl", "mtrl")


def mean_and_error(values: list[float]) -> dict[str, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": round(mean, 4), "standard_error": round(spread / math.sqrt(n), 4), "n": n}


def seed_row(race: dict[str, Any]) -> dict[str, Any]:
    """What one seed's race (bench/trl_peer.py's output) contributes to the comparison."""
    row: dict[str, Any] = {
        "seed": race["work"]["overrides"]["seed"],
        "ratio_mtrl_over_trl": race["ratio_mtrl_over_trl"],
    }
    for side in SIDES:
        result = race[side]
        row[side] = {
            "wall_s": result["wall_s"],
            "generated_tokens": result["generated_tokens"],
            "success_curve": result["success_curve"],
            "last_two_mean": result["success"]["last_two_mean"],
            "held_out": result["success"]["held_out"],
        }
    row["warm_start"] = race["warm_start"]
    if "trl_from" in race:  # TRL's side from an earlier invocation (bench/trl_peer.py --trl-from)
        row["trl_from"] = race["trl_from"]
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means with standard errors over the seeds, and the paired differences mtrl - TRL."""
    measures = {
        "wall_s": lambda side: side["wall_s"],
        "generated_tokens": lambda side: side["generated_tokens"],
        "last_two_mean": lambda side: side["last_two_mean"],
        "held_out_sampled": lambda side: side["held_out"]["sampled"],
        "held_out_greedy": lambda side: side["held_out"]["greedy"],
    }
    out: dict[str, Any] = {
        side: {name: mean_and_error([read(row[side]) for row in rows]) for name, read in measures.items()}
        for side in SIDES
    }
    out["warm_start"] = {
        mode: mean_and_error([row["warm_start"]["held_out"][mode] for row in rows]) for mode in ("sampled", "greedy")
    }
    out["mtrl_minus_trl"] = {
        name: mean_and_error([read(row["mtrl"]) - read(row["trl"]) for row in rows])
        for name, read in measures.items()
        if name != "wall_s"
    }
    ratios = [row["ratio_mtrl_over_trl"] for row in rows]
    out["ratio_mtrl_over_trl"] = {**mean_and_error(ratios), "max": max(ratios)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--held-out", type=int, default=256, help="fixed calculator tasks scored after training")
    parser.add_argument("--iterations", type=int, default=4, help="RL iterations of each side")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "trl_peer_smollm2_seeds.json")
    parser.add_argument(
        "--trl-from",
        type=Path,
        default=None,
        help="earlier seeds' results (their --out): a seed to run whose race is there re-runs only mtrl's side",
    )
    args = parser.parse_args()
    rows = []
    for seed in (int(text) for text in args.seeds.split(",")):
        race_file = args.out.with_name(f"{args.out.stem}_seed{seed}.json")
        if not race_file.is_file():
            command = [sys.executable, str(Path(__file__).with_name("trl_peer.py")), "--model", "smollm2"]
            command += ["--seed", str(seed), "--held-out", str(args.held_out), "--iterations", str(args.iterations)]
            if (
                args.trl_from
                and (earlier := args.trl_from.with_name(f"{args.trl_from.stem}_seed{seed}.json")).is_file()
            ):
                command += ["--trl-from", str(earlier)]
            subprocess.run([*command, "--out", str(race_file)], check=True)
        race = json.loads(race_file.read_text())
        work = (race["work"]["overrides"]["iterations"], race["trl"]["success"]["held_out"]["tasks"])
        if work != (args.iterations, args.held_out):
            raise SystemExit(f"{race_file} is a race of other work (iterations, held-out tasks) {work}: move it away")
        rows.append(seed_row(race))
    report = {"machine": machine(), "seeds": rows, "over_seeds": summary(rows)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["over_seeds"], indent=2))


if __name__ == "__main__":
    main()
