"""The interpreter's start and exit, cheaper for a process that imports torch, transformers,
datasets and Prefect and then exits: the `mtrl` command and the Prefect servers it starts.

- untracked_imports(): imports run with the cycle collector off, and what they made is then
  frozen out of later collections (gc.freeze). They make a few hundred thousand objects that
  live as long as the process; collecting while they are made walks all of them again and again
  and finds nothing (measured on 2 cores: six full collections, ~0.45 s of a default `mtrl run`;
  the Prefect server answered its first request ~1.2 s sooner), and once frozen a full
  collection skips them.
- exit_without_teardown(status): exit as the interpreter does, minus its teardown of every module
  and object one by one (~1.3 s after a run, 2 cores), which writes nothing. What an exit must do
  still happens, in CPython's own order (Py_FinalizeEx): threading's exit hooks and the joins of
  non-daemon threads, then the atexit hooks (Prefect sends its last logs, the temporary Prefect
  server stops, temporary files go, logging flushes), then stdout and stderr are flushed. It
  calls two private functions of CPython, so it runs only on the versions it was checked on
  (FAST_EXIT_PYTHONS) and not with MTRL_FAST_EXIT=0; elsewhere it is a plain sys.exit.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# CPython versions whose exit sequence exit_without_teardown repeats (tests/test_interpreter.py
# checks it on the one that runs the tests): threading._shutdown, then atexit._run_exitfuncs.
FAST_EXIT_PYTHONS = ((3, 11), (3, 12), (3, 13))


def fast_exit_supported() -> bool:
    """May exit_without_teardown skip the teardown here? Only on a CPython it was checked on,
    with both private functions present, and unless MTRL_FAST_EXIT=0."""
    return (
        sys.implementation.name == "cpython"
        and sys.version_info[:2] in FAST_EXIT_PYTHONS
        and callable(getattr(threading, "_shutdown", None))
        and callable(getattr(atexit, "_run_exitfuncs", None))
        and os.environ.get("MTRL_FAST_EXIT", "1") != "0"
    )


def exit_without_teardown(status: int) -> NoReturn:
    """Exit with `status`: the threads' and exit hooks, flushed output, no module teardown."""
    if not fast_exit_supported():
        sys.exit(status)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextmanager
def untracked_imports(enabled: bool = True) -> Iterator[None]:
    """Run the block (a command's imports) with the cycle collector off, then freeze what exists
    and turn the collector back on. `enabled=False`: nothing changes (a test calling a command
    in its own long-lived process keeps its collector as it is)."""
    if not enabled:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
