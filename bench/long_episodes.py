"""Does a turn cost the same at turn 50 as at turn 1? One iteration of 50-turn episodes.

    python bench/long_episodes.py [--rollouts 64] [--group-size 8] [--label after]
                                  [--out bench/results/long_episodes_cpu.json]

Runs `mtrl run --iterations 1` in a fresh runs directory on the embedded model with the task
`long-guess` defined here (this file is also the plugin the run imports): guess-number that never
ends early, a new hidden number after each correct guess, so every rollout plays all 50 turns
(unless its context fills up). Then it reads the run's log (RUNS_DIR/logs/run-*.json,
runtime/phases.py): one section per turn and one for the iteration, each with the time the stages
spent on their own work (`stage_compute`: generation, tool calls and the environment, rewards,
advantages, the update), and reports per turn

    outside = the turn's wall time - its stages' compute

which is everything the pipeline adds to a turn: Prefect's task runs, versions, reading the inputs,
writing the datasets, manifests, artifacts. The floors: outside at the last turn <= 1.2x at the
second (the first continuing turn; the first turn also samples tasks and renders prompts), also as
means of five turns at each end; orchestration (the iteration's wall time minus all its stages'
compute) <= 10% of the iteration. Results go into the JSON with the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import machine

REPO = Path(__file__).resolve().parents[1]
TURNS = 50

if __name__ != "__main__":  # imported by the run as its plugin: register the task
    from stages.environments import ENVIRONMENTS, GUESS_RANGE, EnvStep, GuessNumberEnv

    class LongGuessEnv(GuessNumberEnv):
        """guess-number for exactly 50 turns: a correct guess starts a new round with a new hidden
        number (from the task's and the round's seed), and a turn without a tool call is told to
        use the tool; the reward counts the rounds won."""

        name = "long-guess"
        max_turns = TURNS

        def step(self, task, turn, assistant_text, tool_calls, tool_results, state) -> EnvStep:
            rounds = state.get("rounds", 0)
            low, high = state.get("low", GUESS_RANGE[0]), state.get("high", GUESS_RANGE[1])
            secret = random.Random(f"{task['secret']}/{rounds}").randint(*GUESS_RANGE)
            observation = []
            for call in tool_calls:
                number = call["arguments"].get("number")
                if not isinstance(number, int):
                    observation.append({"role": "tool", "content": "the guess must be an integer"})
                    continue
                if number == secret:
                    rounds, (low, high) = rounds + 1, GUESS_RANGE
                    secret = random.Random(f"{task['secret']}/{rounds}").randint(*GUESS_RANGE)
                    answer = "correct: a new number"
                elif number < secret:
                    low, answer = max(low, number + 1), "higher"
                else:
                    high, answer = min(high, number - 1), "lower"
                observation.append({"role": "tool", "content": f"{answer}: between {low} and {high}"})
            observation = observation or [{"role": "user", "content": "Use the guess tool."}]
            return EnvStep(observation=observation, state={"low": low, "high": high, "rounds": rounds})

        def reward(self, task: dict[str, Any], final_turn: dict[str, Any]) -> float:
            return json.loads(final_turn["next_env_state"]).get("rounds", 0) / 10

    ENVIRONMENTS[LongGuessEnv.name] = LongGuessEnv()


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--label", default="", help="what this run measures (e.g. before, after)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "long_episodes_cpu.json")
    args = parser.parse_args()

    runs = Path(tempfile.mkdtemp(prefix="mtrl-long-episodes-"))
    mtrl = Path(sys.executable).with_name("mtrl")
    command = [
        str(mtrl), "run", "--iterations", "1", "--task", "long-guess",
        "--rollouts", str(args.rollouts), "--group-size", str(args.group_size),
        "--set", 'task.plugins=["long_episodes"]', "--runs-dir", str(runs),
    ]  # fmt: skip
    load_before = os.getloadavg()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO / "bench", capture_output=True, text=True)
    command_s = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"mtrl run failed:\n{done.stderr[-3000:]}")
    log = json.loads(next((runs / "logs").glob("run-*.json")).read_text())
    sections = log["phases"]["sections"]
    turns = [
        {
            "turn": index,
            "wall_s": turn["wall_s"],
            "stage_compute_s": turn.get("stage_compute_s", 0.0),
            "outside_s": round(turn["wall_s"] - turn.get("stage_compute_s", 0.0), 4),
        }
        for index, turn in enumerate(sections["turn"])
    ]
    iteration = sections["iteration"][0]
    outside = [turn["outside_s"] for turn in turns]
    orchestration_s = iteration["wall_s"] - iteration.get("stage_compute_s", 0.0)
    report = {
        "question": "the time a turn spends outside the stages' compute, at turn 50 against turn 1",
        "label": args.label,
        "command": " ".join(command),
        "machine": machine(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "command_s": round(command_s, 2),
        "turns_played": len(turns),
        "iteration_wall_s": iteration["wall_s"],
        "iteration_stage_compute_s": iteration.get("stage_compute_s", 0.0),
        "orchestration_s": round(orchestration_s, 3),
        "orchestration_share": round(orchestration_s / iteration["wall_s"], 4),
        "outside_last_over_second": round(outside[-1] / outside[1], 3),
        "outside_last5_over_turns_1_to_5": round(mean(outside[-5:]) / mean(outside[1:6]), 3),
        "turns": turns,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "turns"}, indent=2))
    print(f"outside per turn (s): {' '.join(f'{x:.3f}' for x in outside)}")


if __name__ == "__main__":
    main()
