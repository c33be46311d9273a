"""Tool calls: parse <tool_call> blocks (Hermes/Qwen3: one JSON object; SmolLM2: a JSON list of
them), validate arguments against the tool's schema, and run the calls of one message
concurrently, each in a killable process.

Nothing here raises on model output. Every failure becomes a ToolResult whose `content` the
model can read and whose `error` is one of FAILURE_KINDS. A tool that cannot run as configured
(the sandbox on, and a tool a worker cannot import) is a configuration error: a ValueError,
which stages/registry.py's check_tasks raises at run start already.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.hermes import ToolCall, parse_tool_calls  # noqa: F401  (execute-tools parses with it)
from stages.tools import (
    INJECTED_PARAMETERS,
    NOT_SANDBOXABLE,
    RemoteTool,
    importable_by_name,
    tool_schema,
    truncate,
)

FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "crashed")


@dataclass
class ToolResult:
    content: str  # what goes into <tool_response>
    error: str | None = None  # None, or the failure kind: one of FAILURE_KINDS
    call_id: str = ""


# ----------------------------------------------------------------------------- validation

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def validate_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A message the model can read if the arguments do not fit the schema, else None."""
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties)}"
    for name, value in arguments.items():
        expected = properties[name].get("type")
        allowed = _JSON_TYPES.get(expected, (object,)) if isinstance(expected, str) else (object,)
        if isinstance(value, bool) and expected in ("integer", "number"):
            allowed = ()  # JSON true is not a number
        if not isinstance(value, allowed):
            return f"argument '{name}' must be of type {expected}, got {type(value).__name__}"
        if "enum" in properties[name] and value not in properties[name]["enum"]:
            return f"argument '{name}' must be one of {properties[name]['enum']}"
    return None


def rejected_call(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> ToolResult | None:
    """The error result of a call that must not run at all (malformed, an unknown tool, arguments
    that do not fit its schema), else None. `schemas`: the JSON schema of each tool by name."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}", "malformed", call.id)
    if call.name not in schemas:
        return ToolResult(
            f"Error: unknown tool '{call.name}'; available: {', '.join(schemas)}", "unknown_tool", call.id
        )
    problem = validate_arguments(schemas[call.name], call.arguments)
    if problem is not None:
        return ToolResult(f"Error: {problem}", "bad_arguments", call.id)
    return None


# ----------------------------------------------------------------------------- running

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
# How much of a dead worker's stderr its error result quotes: the rollout's `failure` keeps the
# first 1000 characters of the message, which leaves room for the words around the quote.
STDERR_TAIL_CHARS = 800


def _exit_status(returncode: int) -> str:
    """'exit code 1', or 'signal SIGSEGV' for a process a signal ended (Popen's negative codes)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:  # a real-time signal has no name
        return f"signal {-returncode}"


class _Worker:
    """One tool process (worker.py): JSON lines in and out, killed when a call overruns.

    Its stderr (tracebacks, faulthandler's dump on a fatal signal, what tools print) goes to a
    temporary file, not a pipe that nobody reads, so a worker never blocks on it; once the
    worker is dead, `exit_report` says how it ended and quotes the end of that file.
    """

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        self.modules: set[str] = set()
        self.stderr = tempfile.TemporaryFile()
        self.exit_report = ""  # set by kill()
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
            start_new_session=True,  # a signal to our process group does not reach it mid-call
        )
        try:
            self.process.stdin.write(json.dumps(sys.path) + "\n")
            self.process.stdin.flush()
        except OSError:  # it died at once: wait_ready finds out
            pass

    def wait_ready(self, timeout_s: float) -> bool:
        return self._readline(time.monotonic() + timeout_s) is not None

    def preload(self, modules: set[str], timeout_s: float) -> bool:
        """Load tool modules now, so that a call's deadline does not pay for the import."""
        missing = modules - self.modules
        if not missing:
            return True
        files = {name: getattr(sys.modules[name], "__file__", None) for name in missing}
        try:
            self.process.stdin.write(json.dumps({"import": files}) + "\n")
            self.process.stdin.flush()
        except OSError:
            return False
        if self._readline(time.monotonic() + timeout_s) is None:
            return False
        self.modules |= missing
        return True

    def _readline(self, deadline: float) -> str | None:
        """The worker's next line, or None when it wrote none by the deadline or closed its stdout (died)."""
        ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        return (self.process.stdout.readline() or None) if ready else None

    def call(self, tool: Callable[..., Any], arguments: dict, deadline: float, max_chars: int) -> ToolResult | None:
        """The result, or None when the worker overran the deadline or died (then it is killed)."""
        request = {"module": tool.__module__, "name": tool.__qualname__, "arguments": arguments, "max_chars": max_chars}
        # Each call starts an empty stderr file: a crash is reported with what this call wrote,
        # and a tool that prints on every call cannot fill the disk. The worker, waiting for
        # this request, shares the file's offset, so both go back to 0.
        os.ftruncate(self.stderr.fileno(), 0)
        os.lseek(self.stderr.fileno(), 0, os.SEEK_SET)
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self._readline(deadline)
            if line:
                reply = json.loads(line)
                return ToolResult(str(reply["content"]), reply["error"])
        except (OSError, ValueError, KeyError):
            pass
        self.kill()
        return None

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """End the process if it still runs; keep how it ended in `exit_report`."""
        if self.alive():
            self.process.kill()
        self.process.wait()
        if self.stderr.closed:
            return
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        # read generously (a character is up to 4 bytes, and the module list below is dropped)
        end = os.pread(fd, 16 * STDERR_TAIL_CHARS, max(0, size - 16 * STDERR_TAIL_CHARS)).decode(errors="replace")
        # faulthandler closes its dump with one long line listing every loaded extension module:
        # noise that would push the traceback out of the quote
        lines = [line for line in end.splitlines() if not line.startswith("Extension modules:")]
        tail = "\n".join(lines).strip()[-STDERR_TAIL_CHARS:]
        self.stderr.close()
        status = _exit_status(self.process.returncode)
        self.exit_report = f"{status}; its stderr ends with:\n{tail}" if tail else f"{status}, nothing on its stderr"


class _WorkerPool:
    """Idle tool workers, started ahead of any deadline (a worker imports the tools once)."""

    STARTUP_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def reserve(self, count: int, memory_mb: int, modules: set[str]) -> tuple[list[_Worker], str]:
        """Workers ready to call tools of these modules (fewer if some fail to start), and the
        exit report of one that failed to start ('' when all started)."""
        with self._lock:
            taken = [w for w in self._idle if w.memory_mb == memory_mb and w.alive()][:count]
            self._idle = [w for w in self._idle if w not in taken]
        started = [_Worker(memory_mb) for _ in range(count - len(taken))]
        ready, start_failure = [], ""
        for worker in taken + started:
            if (worker in taken or worker.wait_ready(self.STARTUP_TIMEOUT_S)) and worker.preload(
                modules, self.STARTUP_TIMEOUT_S
            ):
                ready.append(worker)
            else:
                worker.kill()
                start_failure = worker.exit_report
        return ready, start_failure

    def release(self, workers: list[_Worker]) -> None:
        with self._lock:
            self._idle += [w for w in workers if w.alive()]

    def close(self) -> None:
        with self._lock:
            for worker in self._idle:
                worker.kill()
            self._idle = []


_POOL = _WorkerPool()


def _call_in_thread(tool: Callable[..., Any], arguments: dict, max_chars: int) -> ToolResult:
    try:
        return ToolResult(truncate(str(tool(**arguments)), max_chars))
    except Exception as exc:  # a tool that raises gives the model an error message, not a crash
        return ToolResult(truncate(f"Error: {exc.__class__.__name__}: {exc}", max_chars), "raised")


def run_tool_calls(
    calls: list[ToolCall],
    tools: dict[str, Callable[..., Any]],
    timeout_s: float,
    max_output_chars: int = 2000,
    *,
    task: dict[str, Any] | None = None,
    sandbox: bool = True,
    memory_mb: int = 512,
) -> list[ToolResult]:
    """Run the calls of one message concurrently. Never raises on model output: failures become
    error results.

    With `sandbox` each call runs in a separate worker process with a memory limit, killed
    at the deadline (and replaced); a tool a worker cannot import by name (a lambda, a closure,
    a function of __main__) is a ValueError, whichever calls the model made. Without it each
    call runs in a thread, which is abandoned, not killed, at the deadline. A RemoteTool runs
    in its own server, which keeps the same deadline (stages/tools.py).
    `task` is passed to tools that take a `task` parameter.
    """
    if sandbox:
        for name, tool in tools.items():
            if not isinstance(tool, RemoteTool) and not importable_by_name(tool):
                raise ValueError(f"tool '{name}' {NOT_SANDBOXABLE}")
    schemas = {name: tool_schema(tool) for name, tool in tools.items()}
    rejected = [rejected_call(call, schemas) for call in calls]
    runnable = [i for i, rejection in enumerate(rejected) if rejection is None]  # call indexes
    remote = {i for i in runnable if isinstance(tools[calls[i].name], RemoteTool)}
    isolated = [i for i in runnable if i not in remote] if sandbox else []
    modules = {tools[calls[i].name].__module__ for i in isolated}
    workers, start_failure = _POOL.reserve(len(isolated), memory_mb, modules) if isolated else ([], "")
    worker_of = dict(zip(isolated, workers))
    deadline = time.monotonic() + timeout_s  # the calls run concurrently: one shared deadline

    def run(index: int) -> ToolResult:
        call, tool = calls[index], tools[calls[index].name]
        if index in remote:
            content, error = tool.call(call.arguments, timeout_s, max_output_chars)
            return ToolResult(content, error)
        arguments = dict(call.arguments)
        for name in INJECTED_PARAMETERS:
            if name in inspect.signature(tool).parameters:
                arguments[name] = task
        if not sandbox:
            return _call_in_thread(tool, arguments, max_output_chars)
        if index not in worker_of:
            message = f"Error: no worker process could start for tool '{call.name}' ({start_failure})"
            return ToolResult(truncate(message, max_output_chars), "crashed")
        worker = worker_of[index]
        result = worker.call(tool, arguments, deadline, max_output_chars)
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            return ToolResult(f"Error: tool '{call.name}' timed out after {timeout_s:g} s", "timeout")
        message = f"Error: tool '{call.name}' crashed its worker process ({worker.exit_report})"
        return ToolResult(truncate(message, max_output_chars), "crashed")

    pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(runnable))), thread_name_prefix="mtrl-tool")
    futures = {i: pool.submit(run, i) for i in runnable}
    results = []
    for index, (call, rejection) in enumerate(zip(calls, rejected)):
        result = rejection
        if result is None:
            # a worker is killed at the deadline; the extra second covers the kill. A remote tool
            # keeps its own deadline once its server is ready, which may take its start timeout.
            grace = 1.0 + (tools[call.name].start_timeout_s if index in remote else 0.0)
            try:
                result = futures[index].result(timeout=max(0.0, deadline - time.monotonic()) + grace)
            except FutureTimeout:
                result = ToolResult(f"Error: tool '{call.name}' timed out after {timeout_s:g} s", "timeout")
        results.append(ToolResult(result.content, result.error, call.id))  # each path truncated already
    pool.shutdown(wait=False, cancel_futures=True)  # a hung thread is abandoned, not joined
    _POOL.release(workers)
    return results
