"""Where a process's time goes, measured by the code itself: moments (marks, wall clock), named
spans (seconds, summed over their calls) and sections (a span that also records how much of each
other span fell inside it, e.g. one per iteration).

`mtrl run` writes what its process recorded into the run's log (RUNS_DIR/logs/run-*.json), so a
benchmark reads the split of a run instead of patching the code it measures. Standard library
only, and cheap: a span costs two clock reads.
"""

from __future__ import annotations

import functools
import os
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


class Phases:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sections: dict[str, list[dict[str, float]]] = defaultdict(list)
        self._open: set[str] = set()

    def mark(self, name: str) -> None:
        """This moment, as `name` (the first time only: a mark is when something first happened)."""
        self.marks.setdefault(name, time.time())

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Add the block's duration to `name`. A span inside a span of the same name counts once."""
        if name in self._open:
            yield
            return
        self._open.add(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1
            self._open.discard(name)

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
        before = dict(self.seconds)
        started = time.perf_counter()
        try:
            with self.span(name):
                yield
        finally:
            inside = {f"{k}_s": round(v - before.get(k, 0.0), 4) for k, v in self.seconds.items() if k != name}
            self.sections[name].append({"wall_s": round(time.perf_counter() - started, 4), **inside})

    def as_dict(self) -> dict[str, Any]:
        return {
            "process_started": process_started(),
            "marks": dict(self.marks),
            "seconds": {name: round(value, 4) for name, value in self.seconds.items()},
            "calls": dict(self.calls),
            "sections": {name: list(runs) for name, runs in self.sections.items()},
        }


PHASES = Phases()  # this process's
