"""A tool worker process: runs tool calls one at a time, speaking JSON lines on stdin/stdout.

Started by calls.py as `python worker.py MEMORY_MB` (a script, not `-m`, so that it imports
nothing it does not need). The first input line is the parent's sys.path; then each request

    {"module": ..., "name": ..., "arguments": {...}, "max_chars": N}

is answered with {"content": ..., "error": null | "raised"}; {"import": {module: file}} loads
tool modules ahead of time and is answered with {"imported": true}. JSON both ways: the parent never
unpickles anything a tool could have shaped. The parent kills a worker that overruns its
deadline and starts another. Everything else a worker writes (what tools print, tracebacks)
goes to stderr, which the parent quotes when a worker dies.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import resource
import sys


def _limit_memory(megabytes: int | None) -> None:
    """Cap the address space at what is mapped now plus a budget (None: lift the cap). Only
    the soft limit, so it can be lifted again after the call; this guards against runaway
    memory, it is not a security boundary (tool code runs with our privileges)."""
    if megabytes is None:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + megabytes * 2**20, resource.RLIM_INFINITY))


def _load(module: str, file: str | None) -> None:
    """Load a tool module from its file, without running its packages' __init__ (which may
    import heavy libraries the tool does not need); by name when there is no file."""
    if module in sys.modules:
        return
    if file is None:
        importlib.import_module(module)
        return
    spec = importlib.util.spec_from_file_location(module, file)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [truncated {len(text) - max_chars} characters]"


def serve(memory_mb: int) -> None:
    faulthandler.enable()  # a fatal signal (a segfault in a native library) dumps the Python stack to stderr
    replies = sys.stdout
    sys.stdout = sys.stderr  # a tool that prints must not corrupt the reply channel
    sys.path[:] = json.loads(sys.stdin.readline())
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if "import" in request:  # warm-up before any deadline: {"import": {module: file}}
            for module, file in request["import"].items():
                _load(module, file)
            replies.write('{"imported": true}\n')
            replies.flush()
            continue
        try:
            tool = sys.modules[request["module"]]  # loaded by an earlier {"import": ...}
            for part in request["name"].split("."):
                tool = getattr(tool, part)
            _limit_memory(memory_mb)
            try:
                content, error = str(tool(**request["arguments"])), None
            finally:
                _limit_memory(None)
        except MemoryError:
            content, error = f"Error: MemoryError: the tool used more than {memory_mb} MB", "raised"
        except Exception as exc:  # a tool that raises gives the model an error message
            content, error = f"Error: {exc.__class__.__name__}: {exc}", "raised"
        replies.write(json.dumps({"content": _truncate(content, request["max_chars"]), "error": error}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
