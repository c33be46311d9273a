"""The `python` tool: run a program the model wrote and give it what the program printed.

Model output is untrusted code, so it never runs in mtrl's processes. Each call writes the
program into a fresh temporary folder and runs it in a separate interpreter,

    python -I stages/python_tool.py MEMORY_MB CPU_SECONDS PROGRAM   (through runtime/processes.py)

which caps its own memory, CPU time, file sizes and open files, then runs the program. The
child is killed when the thread that started it ends (a tool worker killed at its deadline, a
SIGKILLed mtrl) and after PYTHON_TIMEOUT_S of wall time. It runs with our user's rights and
network, like every tool: a guard against runaway programs, not a security boundary (run mtrl
in a container for that).

Loaded by file in tool workers (stages/execute_tools/worker.py) and run by path as a script:
standard library only at import time.
"""

from __future__ import annotations

import os
import resource
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

MAX_CODE_CHARS = 10_000
PYTHON_TIMEOUT_S = 10.0  # wall time of one program; a tool worker's deadline (tools.timeout_s) may end it first
PYTHON_CPU_SECONDS = 10
PYTHON_MEMORY_MB = 512
PYTHON_FILE_MB = 16  # largest file a program may write (into its temporary folder)
PYTHON_OPEN_FILES = 64
TEMP_PREFIX = "mtrl-python-"  # each call's folder: the program, and what it writes


def python(code: str) -> str:
    """Run a Python program and return what it prints (standard output, then standard error).

    Args:
        code: The program, for example "print(sum(range(1, 11)))".
    """
    import signal

    from runtime.files import owned_temp_folder  # imported here: the runner below has no mtrl
    from runtime.processes import dies_with_this_thread

    if not isinstance(code, str) or len(code) > MAX_CODE_CHARS:
        raise ValueError(f"code must be a string of at most {MAX_CODE_CHARS} characters")
    # named by this worker: a worker killed at its deadline leaves it, and the next call removes it
    folder = owned_temp_folder(TEMP_PREFIX)
    try:
        program = folder / "program.py"
        program.write_text(code)
        runner = [sys.executable, "-I", str(Path(__file__).resolve()), str(PYTHON_MEMORY_MB), str(PYTHON_CPU_SECONDS)]
        try:
            done = subprocess.run(
                dies_with_this_thread([*runner, str(program)], signal.SIGKILL),  # no handler can refuse it
                cwd=folder,
                env={"PATH": os.defpath, "PYTHONIOENCODING": "utf-8"},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=PYTHON_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the program ran longer than {PYTHON_TIMEOUT_S:g} s") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:  # an exception's traceback is the answer the model needs: not a tool failure
        output += f"\n(exit status {done.returncode})"
    return output or "(no output)"


def _run_limited(memory_mb: int, cpu_seconds: int, program: str) -> None:
    """In the child: cap its resources, then run the program as __main__."""
    limits = {
        resource.RLIMIT_AS: memory_mb * 2**20,
        resource.RLIMIT_CPU: cpu_seconds,
        resource.RLIMIT_FSIZE: PYTHON_FILE_MB * 2**20,
        resource.RLIMIT_NOFILE: PYTHON_OPEN_FILES,
        resource.RLIMIT_CORE: 0,
    }
    for kind, limit in limits.items():
        resource.setrlimit(kind, (limit, limit))
    sys.argv = [program]
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    _run_limited(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
