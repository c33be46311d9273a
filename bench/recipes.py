"""The choices a user meets first, measured on the same work and seeds: a recipe table.

    python bench/recipes.py [--seeds 0,1,2] [--recipes default,rloo,...] [--held-out 256] [--iterations 4]

The work is bench/trl_peer.py's SmolLM2 race, mtrl's side: SmolLM2-135M-Instruct warm-started by
`mtrl sft` with the seed, then --iterations of RL on 32 calculator rollouts in groups of 8, then
`mtrl eval` of the last policy on --held-out fixed calculator tasks, sampled and greedy. Each recipe
changes mtrl's defaults by the --set values of RECIPES, nothing else; the same seed gives every
recipe the same warm start (it is made once per seed) and the same tasks. A recipe that a race of
bench/trl_seeds.py ran as its mtrl side (the default; the old default, overlong_penalty) is taken from
that race's file where it exists (RACES).

Each (recipe, seed) is written to its own file beside --out (FILE_<recipe>_seed<S>.json); one whose
file exists is read, not run again, so the table can be filled over several sittings. Written to
--out (default: recipes_smollm2.json in bench/results): every cell's runs, and per recipe the mean and
standard error over the seeds of held-out success (sampled, greedy), last-two training success and
wall time, and the paired difference from the default recipe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orchestration import REPO, measure_mtrl  # noqa: E402
from provenance import machine  # noqa: E402
from trl_peer import first_and_last_two, held_out_success, smollm2_work  # noqa: E402
from trl_seeds import mean_and_error  # noqa: E402

from pipeline.store.lineage import latest_policy  # noqa: E402
from pipeline.store.versions import Store  # noqa: E402
from runtime.files import replace_file  # noqa: E402

RECIPES: dict[str, dict[str, object]] = {  # name -> the --set values it changes
    "default": {},
    "rloo": {"advantage.estimator": "rloo"},
    "gae": {"advantage.estimator": "gae"},  # with its value head
    "dr_grpo": {"advantage.normalize_by_std": "false"},  # group mean removed, no std division
    "kl_0.05": {"ppo.kl_coef": 0.05},
    # the default until 2026-11-29 (DAPO's overlong penalty): a turn cut at max_new_tokens scored -0.5, not 0
    "overlong_penalty": {"reward.overlong_reward": -0.5},
    # TRL's reading of a tool call its parser cannot read: the turn is the final answer (mtrl's default answers
    # the call with its parse error and the rollout goes on): one of the ways the two sides of the race differ
    "malformed_call_answer": {"tools.malformed_call": "answer"},
    "seq_mean_loss": {"ppo.loss_aggregation": "seq-mean-token-mean"},
    "two_epochs": {"ppo.epochs": 2},
}
FIRST = "default,rloo,gae,dr_grpo,kl_0.05,overlong_penalty"  # the table's first columns; the others when time allows


def run_recipe(
    recipe: str, start: Path, overrides: dict[str, Any], held_out_tasks: int, workdir: Path
) -> dict[str, Any]:
    """One `mtrl run` of the recipe from the warm start, and its last policy's held-out success."""
    settings = {**overrides, **RECIPES[recipe]}
    runs_dir = workdir / f"runs-{recipe}"
    result = measure_mtrl(["--model", str(start), *(f"--set={k}={v}" for k, v in settings.items())], runs_dir)
    held_out = held_out_success(start, runs_dir, held_out_tasks, policy=latest_policy(Store(runs_dir)))
    shutil.rmtree(runs_dir)  # ~0.5 GB per SmolLM2 policy: a table's runs would fill the disk
    return recipe_cell(recipe, result, held_out)


def recipe_cell(recipe: str, result: dict[str, Any], held_out: dict[str, float]) -> dict[str, Any]:
    """What a table cell keeps of one mtrl run (measure_mtrl's result) and its held-out success."""
    return {
        "recipe": recipe,
        "sets": RECIPES[recipe],
        **{key: result[key] for key in ("wall_s", "generated_tokens", "success_curve")},
        "success": first_and_last_two(result["success_curve"]),
        "held_out": held_out,
    }


# Recipes whose runs bench/trl_seeds.py's races already made (their mtrl side: the same warm start, work and
# settings): recipe -> the --out stem of those races. The default's race is the current one; the old default's
# was kept under its own name when the default changed.
RACES = {"default": "trl_peer_smollm2_seeds", "overlong_penalty": "trl_peer_smollm2_seeds_overlong_penalty"}


def cell_from_race(recipe: str, seed: int, results: Path) -> dict[str, Any] | None:
    """The recipe's cell for `seed` from the race of that seed that ran it, if there is one (not run twice)."""
    if recipe not in RACES or not (race_file := results / f"{RACES[recipe]}_seed{seed}.json").is_file():
        return None
    race = json.loads(race_file.read_text())
    return {
        "seed": seed,
        **recipe_cell(recipe, race["mtrl"], race["mtrl"]["success"]["held_out"]),
        "work": {"overrides": race["work"]["overrides"], "machine": race["machine"]},
        "from_race": race_file.name,
    }


def table(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per recipe: means with standard errors over the seeds, and the paired difference from the default."""
    measures = {
        "held_out_sampled": lambda cell: cell["held_out"]["sampled"],
        "held_out_greedy": lambda cell: cell["held_out"]["greedy"],
        "last_two_mean": lambda cell: cell["success"]["last_two_mean"],
        "wall_s": lambda cell: cell["wall_s"],
    }
    out = {}
    for recipe, runs in cells.items():
        out[recipe] = {name: mean_and_error([read(run) for run in runs]) for name, read in measures.items()}
        if recipe != "default" and len(cells.get("default", [])) == len(runs):
            out[recipe]["minus_default"] = {
                name: mean_and_error([read(run) - read(base) for run, base in zip(runs, cells["default"], strict=True)])
                for name, read in measures.items()
            }
    return out


def markdown(rows: dict[str, Any]) -> str:
    """table()'s rows as the docs' table: each cell mean +- standard error over the seeds."""

    def cell(stats: dict[str, float], digits: int) -> str:
        return f"{stats['mean']:.{digits}f} ± {stats['standard_error']:.{digits}f}"

    lines = [
        "| recipe | `--set` | held-out sampled | held-out greedy | training, last two | wall s "
        "| sampled − default, paired | greedy − default, paired |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for recipe, stats in rows.items():
        sets = ", ".join(f"`{key}={value}`" for key, value in RECIPES[recipe].items()) or "(none)"
        paired = stats.get("minus_default", {})
        differences = [
            cell(paired[name], 3) if name in paired else "" for name in ("held_out_sampled", "held_out_greedy")
        ]
        lines.append(
            f"| {recipe} | {sets} | {cell(stats['held_out_sampled'], 3)} | {cell(stats['held_out_greedy'], 3)} "
            f"| {cell(stats['last_two_mean'], 2)} | {cell(stats['wall_s'], 0)} | {' | '.join(differences)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--recipes", default=FIRST, help=f"comma-separated, of: {', '.join(RECIPES)}")
    parser.add_argument("--held-out", type=int, default=256, help="fixed calculator tasks scored after training")
    parser.add_argument("--iterations", type=int, default=4, help="RL iterations of each run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recipes_smollm2.json")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        raise SystemExit(f"unknown recipes {sorted(unknown)}: choose from {', '.join(RECIPES)}")
    ran_on = machine()  # at the start: the commit (and edits) that ran, not what the tree holds at the end
    cells: dict[str, list[dict[str, Any]]] = {recipe: [] for recipe in recipes}
    for seed in (int(text) for text in args.seeds.split(",")):
        workdir, warm = Path(tempfile.mkdtemp(prefix=f"mtrl-recipes-seed{seed}-")), None
        for recipe in recipes:
            cell_file = args.out.with_name(f"{args.out.stem}_{recipe}_seed{seed}.json")
            if not cell_file.is_file() and (cell := cell_from_race(recipe, seed, args.out.parent)):
                replace_file(cell_file, (json.dumps(cell, indent=2) + "\n").encode())  # read back when run again
            if not cell_file.is_file():
                warm = warm or smollm2_work(args.iterations, seed, workdir)  # once per seed, for every recipe
                start, overrides = warm
                cell = {"seed": seed, **run_recipe(recipe, start, overrides, args.held_out, workdir)}
                cell["work"] = {"overrides": overrides, "machine": ran_on}
                replace_file(cell_file, (json.dumps(cell, indent=2) + "\n").encode())  # read back when run again
            cell = json.loads(cell_file.read_text())
            work = (cell["work"]["overrides"]["iterations"], cell["held_out"]["tasks"])
            if work != (args.iterations, args.held_out):
                raise SystemExit(
                    f"{cell_file} is a run of other work (iterations, held-out tasks) {work}: move it away"
                )
            cells[recipe].append(cell)
        shutil.rmtree(workdir)
    report = {"machine": ran_on, "seeds": args.seeds, "cells": cells, "table": table(cells)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report["table"]))


if __name__ == "__main__":
    main()
