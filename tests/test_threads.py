"""runner.threads reaches every process mtrl runs (runtime/threads.py); torchrun's ranks are
checked in tests/test_distributed.py (each rank reports its torch thread count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.threads import default_threads

ROOT = Path(__file__).resolve().parents[1]

# A fresh process: this one, its tool workers and its Prefect server all start after use_threads.
PROBE = """
import json, os, sys, tempfile
from pathlib import Path
import psutil
from runtime.threads import use_threads
use_threads(1)  # torch caps the OMP_NUM_THREADS it reads at the cores; its default here: one per core
import torch
from pipeline.prefect_plumbing import servers as prefect_servers
from stages.execute_tools.calls import ToolCall, run_tool_calls
import toolbox

call = ToolCall(name="thread_environment", arguments={}, id="0")
(result,) = run_tool_calls([call], {"thread_environment": toolbox.thread_environment}, timeout_s=60)
with prefect_servers.local_server(Path(tempfile.mkdtemp())):
    (server,) = [p for p in psutil.Process().children(recursive=True) if "prefect_plumbing.api_server" in " ".join(p.cmdline())]
    server_threads = server.environ().get("OMP_NUM_THREADS")
print(json.dumps({"torch": torch.get_num_threads(), "tool_worker": result.content, "prefect_server": server_threads}))
"""


@pytest.mark.slow  # a fresh process, its Prefect server and tool workers
def test_the_thread_setting_reaches_this_process_its_tool_workers_and_its_prefect_server():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"torch": 1, "tool_worker": "1", "prefect_server": "1"}


@pytest.mark.parametrize(("cores", "alone", "overlapping"), [(1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 4, 2), (16, 16, 8)])
def test_the_default_gives_one_stage_every_core_and_two_at_once_half_each(cores, alone, overlapping):
    assert default_threads(overlapping=False, cores=cores) == alone
    assert default_threads(overlapping=True, cores=cores) == overlapping


@pytest.mark.parametrize(
    ("started_with", "setting", "overlapping", "expected"),
    [
        (None, None, False, os.cpu_count()),
        (None, None, True, max(1, os.cpu_count() // 2)),
        ("3", None, False, 3),  # OMP_NUM_THREADS in mtrl's environment: the user's, it wins
        ("3", None, True, 3),
        ("3", 5, False, 5),  # runner.threads wins over both
    ],
)
def test_a_user_setting_wins_over_the_default(started_with, setting, overlapping, expected):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    if started_with is not None:
        env["OMP_NUM_THREADS"] = started_with
    probe = (
        "import os; from runtime.threads import use_threads; "
        f"print(use_threads({setting}, overlapping={overlapping}), os.environ['OMP_NUM_THREADS'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == [str(expected), str(expected)], out.stderr
