"""The suite's own guards (tests/conftest.py)."""

from __future__ import annotations

import logging
import sys
import threading

from _pytest.logging import LogCaptureHandler, catching_logs


def test_log_capture_holds_while_another_thread_makes_loggers():
    """pytest's log capture starts at every phase of every test while threads that earlier tests started
    may make loggers. Without tests/conftest.py's lock this failed 3 runs of 3 ("dictionary changed size
    during iteration"); it takes about 0.05 s."""
    names = [f"test-harness-{index}" for index in range(5000)]
    maker = threading.Thread(target=lambda: [logging.getLogger(name) for name in names])
    entries, interval = 0, sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns often: the race shows within the test
    maker.start()
    try:
        while maker.is_alive():
            with catching_logs(LogCaptureHandler()):
                entries += 1
    finally:
        maker.join()
        sys.setswitchinterval(interval)
        for name in names:  # not left in logging's dict for the rest of the session
            logging.Logger.manager.loggerDict.pop(name, None)
    assert entries > 10  # the capture started again and again while the loggers were made
