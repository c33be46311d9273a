"""Should the default keep the KL term? The demo with and without it, seed by seed, in one run.

    python bench/kl_default.py [--seeds 0 1 2] [--out bench/results/kl_default_cpu.json]

`ppo.kl_coef` > 0 needs the reference policy's logprobs of every completion token each iteration:
a whole forward pass in compute-advantages (except in iteration 0, whose rollouts the reference
generated). TRL's GRPOTrainer and the DAPO / Dr. GRPO recipes default to no KL term. For each
seed, in fresh runs directories and one after the other (the same machine state for both):
`mtrl run --seed S` (the default, ppo.kl_coef 0.05, k3 KL in the loss) and the same with
`--set ppo.kl_coef=0`. Reported per run: the success rate of each of the 10 iterations, the first
against the mean of the last two, the command's wall time, and compute-advantages' and
ppo-update's summed wall time (the stages' own, from their manifests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import training_run  # noqa: E402
from provenance import machine  # noqa: E402

SETTINGS = {"kl_0.05 (default)": [], "kl_0": ["--set", "ppo.kl_coef=0"]}


def stage_seconds(runs_dir: Path, stage: str) -> float:
    from pipeline.store.versions import Store

    return round(sum(m.wall_s for m in Store(runs_dir).versions(stage)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kl_default_cpu.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-kl-"))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for seed in args.seeds:
        for name, flags in SETTINGS.items():
            runs_dir = workdir / f"{name}-{seed}"
            run = training_run(runs_dir, "--seed", str(seed), *flags)
            run["compute_advantages_wall_s"] = stage_seconds(runs_dir, "compute-advantages")
            runs[name].append({"seed": seed, **run})
            print(name, json.dumps(runs[name][-1]), flush=True)
    summary = {
        name: {
            "last_two_mean": round(statistics.mean(r["last_two_mean"] for r in results), 4),
            "wall_s": round(statistics.mean(r["wall_s"] for r in results), 1),
            "compute_advantages_wall_s": round(statistics.mean(r["compute_advantages_wall_s"] for r in results), 1),
            "ppo_update_wall_s": round(statistics.mean(r["ppo_update_wall_s"] for r in results), 1),
        }
        for name, results in runs.items()
    }
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
