"""Ctrl-C, remembered. Prefect swallows an exception that lands after a task's or a subflow's code
has finished (it logs "BaseException was raised after user code finished executing"), so a
KeyboardInterrupt delivered there would be lost and the run would go on. `mtrl` sets INTERRUPTED
before raising it, and the flows check it between iterations and turns (pipeline/orchestration/flows.py)."""

from __future__ import annotations

import signal
import threading
from typing import Any

INTERRUPTED = threading.Event()


def remember_interrupts() -> None:
    """From now on SIGINT sets INTERRUPTED, then raises KeyboardInterrupt as Python's default does
    (call it from the main thread)."""
    signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    INTERRUPTED.set()
    signal.default_int_handler(signum, frame)
