"""Does an agent command give the same data twice at scale, and resume to it after a SIGKILL?

    python -m bench.agent_determinism [--rollouts 256] [--agents all] [--out bench/results/agent_determinism_cpu.json]

For each agent (the openai client's tool loop, a sync agent that streams every reply, an agent that rewrites
its history), tests/test_agent_determinism.py's procedure at `--rollouts`: `mtrl run --agent ... --iterations
2` on a quiet machine; the same command under CPU hogs (one bursty busy loop per core and one more, running
while its agents call), SIGKILLed with its process group once its second iteration's agents call, then run
again under the hogs; then `mtrl diff` of the two. A line per agent: the walls, the rows, failed rows, the
agents' processes left after the kill and the diff's verdict. Each `mtrl run` starts a Prefect server of its own, as a user's does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import tempfile
from pathlib import Path

from bench.provenance import machine
from pipeline.cli.main import main as mtrl
from tests.test_agent_determinism import kill_and_resume_under_load

REPO = Path(__file__).resolve().parents[1]
AGENTS = [
    "examples.agents.openai_loop:agent",  # the openai client's tool loop
    "tests.agent_programs:streams_in_sync",  # a sync agent streaming every reply
    "tests.agent_programs:edits_history",  # its second call starts a new segment
]


def diff(first: Path, second: Path) -> tuple[int, str]:
    """`mtrl diff first second`: its exit code and its last line."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = mtrl(["diff", str(first), str(second)])
    return code, printed.getvalue().strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--agents", default="all", help="comma-separated agent functions, or all")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_determinism_cpu.json")
    args = parser.parse_args()
    agents = AGENTS if args.agents == "all" else args.agents.split(",")
    results = {
        "question": "the same agent command, quiet then under CPU hogs and SIGKILLed mid-calls then resumed: same data?",
        "machine": machine(),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_before": [round(load, 2) for load in os.getloadavg()],
        "runs": [],
    }
    for function in agents:
        with tempfile.TemporaryDirectory(prefix="mtrl-determinism-") as folder:
            root = Path(folder)
            report = kill_and_resume_under_load(
                function, args.rollouts, root, dict(os.environ), hogs=(os.cpu_count() or 1) + 1
            )
            rows = report.pop("rows")
            code, verdict = diff(root / "uninterrupted", root / "resumed")
        line = {
            **report,
            "rows": len(rows),
            "failed_rows": sum(bool(row["failed"]) for row in rows),
            "rows_past_turn_0": sum(row["turn"] > 0 for row in rows),
            "diff_exit_code": code,
            "diff": verdict,
        }
        print(json.dumps(line), flush=True)
        results["runs"].append(line)
    results["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
