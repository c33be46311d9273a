"""torchrun (torch.distributed.run), ended as soon as its agent is done.

torchrun mirrors each rank's log files to its own output (`--tee`) with threads that run until
its process context closes. After a SIGTERM (the process that ran the stage was SIGKILLed, so
the kernel sends torchrun SIGTERM) those threads were sometimes never stopped: seen in about
one test run in six, with the ranks gone, the threads still polling the logs and the main
thread waiting for them in the interpreter's exit, forever. Here torchrun's `main` runs as
usual and the process then exits with its status without joining threads. No output is lost:
a close that does stop the threads lets them drain the logs first, and after a SIGTERM the
ranks are gone and nothing reads torchrun's output.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from torch.distributed.run import main

if __name__ == "__main__":
    status = 1
    try:
        main()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a failed rank (ChildFailedError), a signal: printed as Python would
        traceback.print_exc()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM now simply ends the process
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # the process that read it is gone
                pass
        os._exit(status)
