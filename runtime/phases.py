"""Where a process's time goes, measured by the code itself: moments (marks, wall clock), named
spans (seconds, summed over their calls) and sections (a span that also records how much of each
other span fell inside it, e.g. one per iteration).

`mtrl run` writes what its process recorded into the run's log (RUNS_DIR/logs/run-*.json), so a
benchmark reads the split of a run instead of patching the code it measures. Standard library
only, and cheap: a span costs two clock reads.

Threads: spans are the process's. Each thread's open spans are its own, and the sums are
updated under a lock, so a span that runs in two threads at once (with ppo.max_staleness the next
batch is made beside ppo-update) counts the time of both, and a section (an iteration) counts
the spans every thread ran inside it.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def process_started() -> float | None:
    """When this process started (seconds since the epoch, 10 ms resolution), from the kernel:
    before the interpreter ran a line. None where /proc does not tell (not Linux)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: starttime, after the name
        with open("/proc/stat") as system:
            booted = next(int(line.split()[1]) for line in system if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return booted + ticks / os.sysconf("SC_CLK_TCK")


# Module-level, not in a Phases: a flow's code is pickled by value where Prefect runs it in a
# subprocess (a deployment's run), and a lock cannot be pickled.
_LOCK = threading.Lock()  # the sums
_THREAD = threading.local()  # .open: the (Phases, span) pairs open in this thread


class Phases:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sections: dict[str, list[dict[str, float]]] = defaultdict(list)

    def mark(self, name: str) -> None:
        """This moment, as `name` (the first time only: a mark is when something first happened)."""
        self.marks.setdefault(name, time.time())

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Add the block's duration to `name`. A span inside a span of the same name (in the same
        thread) counts once."""
        open_here, key = _THREAD.__dict__.setdefault("open", set()), (id(self), name)
        if key in open_here:
            yield
            return
        open_here.add(key)
        started = time.perf_counter()
        try:
            yield
        finally:
            with _LOCK:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
            open_here.discard(key)

    def timed(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A decorator: every call of the function is a span of `name`."""

        def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                with self.span(name):
                    return function(*args, **kwargs)

            return run

        return decorate

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A span whose every run is also recorded on its own, with the share of each other span in it."""
        with _LOCK:
            before = dict(self.seconds)
        started = time.perf_counter()
        try:
            with self.span(name):
                yield
        finally:
            with _LOCK:
                inside = {f"{k}_s": round(v - before.get(k, 0.0), 4) for k, v in self.seconds.items() if k != name}
                self.sections[name].append({"wall_s": round(time.perf_counter() - started, 4), **inside})

    def as_dict(self) -> dict[str, Any]:
        with _LOCK:
            return {
                "process_started": process_started(),
                "marks": dict(self.marks),
                "seconds": {name: round(value, 4) for name, value in self.seconds.items()},
                "calls": dict(self.calls),
                "sections": {name: list(runs) for name, runs in self.sections.items()},
            }


PHASES = Phases()  # this process's
