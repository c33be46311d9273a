"""The `mtrl` command's start and exit (runtime/interpreter.py): an exit without the teardown that
still does what an exit must, only on a Python it was checked on, and imports untracked by the
cycle collector for every command alike."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.orchestration.stage_table import ROOT
from runtime import interpreter

EXITING = """
import atexit, sys, threading, time
from runtime.interpreter import exit_without_teardown

class Loud:  # its __del__ runs in the interpreter's teardown of module globals, and only there
    def __del__(self):
        print("teardown", flush=True)

kept = Loud()

def late_write():
    time.sleep(0.3)
    open(sys.argv[1], "w").write("joined")

threading.Thread(target=late_write).start()  # not a daemon: an exit waits for it
atexit.register(lambda: print("exit hook", flush=True))
print("unflushed", end="")
exit_without_teardown(3)
"""


@pytest.mark.parametrize("fast", ["1", "0"])
def test_the_exit_joins_threads_runs_the_exit_hooks_flushes_and_keeps_the_status(tmp_path, fast):
    marker = tmp_path / "thread.txt"
    done = subprocess.run(
        [sys.executable, "-c", EXITING, str(marker)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"MTRL_FAST_EXIT": fast, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 3, done.stderr
    assert marker.read_text() == "joined"
    assert done.stdout.startswith("unflushed") and "exit hook" in done.stdout
    # the fast exit skips the teardown of module globals (what it saves); MTRL_FAST_EXIT=0 keeps it
    assert ("teardown" in done.stdout) == (fast == "0"), (interpreter.fast_exit_supported(), done.stdout)


def test_the_fast_exit_runs_only_on_a_python_it_was_checked_on(monkeypatch):
    assert interpreter.fast_exit_supported() == (sys.version_info[:2] in interpreter.FAST_EXIT_PYTHONS)
    monkeypatch.setattr(interpreter, "FAST_EXIT_PYTHONS", ())  # a Python this module was not checked on
    assert not interpreter.fast_exit_supported()
    with pytest.raises(SystemExit) as exited:  # a plain exit, with its status
        interpreter.exit_without_teardown(5)
    assert exited.value.code == 5


COMMAND = """
import gc, json, sys
import pipeline.cli.main as cli

seen = {}

def command_ls(args):
    seen["imports_collected"] = gc.isenabled()
    def work():
        seen.update(work_collected=gc.isenabled(), frozen=gc.get_freeze_count())
    return work

cli.command_ls = command_ls  # parser() reads the handler when it builds the command line
assert cli.main(["ls"], as_command=True) == 0
print(json.dumps(seen))
"""


def test_every_command_imports_untracked_then_works_with_the_collector_on():
    """main() runs every handler (config, imports, checks) with the collector off and its work
    with the collector on, the imports frozen out of its walks; `mtrl audit` once worked with it off."""
    import json

    done = subprocess.run([sys.executable, "-c", COMMAND], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imports_collected"] is False and seen["work_collected"] is True and seen["frozen"] > 0
