"""Prefect's temporary API server, run as Prefect runs it (`python -m uvicorn` on
prefect.server.api.server:create_app, with the same arguments after the first, which is the pid
of the mtrl process that started it), except that:

- it stops when the thread of mtrl that started it ends (stages.processes.die_with_parent),
  set here rather than between fork and exec: mtrl starts it while its main thread imports;
- the server's modules are imported with the garbage collector off: they make a few hundred
  thousand objects that live as long as the server, and collecting while they are made finds
  nothing. Measured on 2 cores: the server answers its first API request in 3.6 s instead of
  4.8 s (mean of four starts each), which is what `mtrl run` waits for before its first flow run.
"""

import gc
import runpy
import sys

from stages.processes import die_with_parent

if __name__ == "__main__":
    die_with_parent(int(sys.argv.pop(1)))
    gc.disable()
    import prefect.server.api.server  # noqa: F401

    gc.freeze()  # what the imports made: left out of every later collection
    gc.enable()
    sys.argv[0] = "uvicorn"
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
