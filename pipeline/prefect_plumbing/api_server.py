"""The Prefect API servers mtrl starts, run as Prefect runs them, under a few settings of mtrl's:

    python -m pipeline.prefect_plumbing.api_server uvicorn ARGS...   (the temporary server)
    python -m pipeline.prefect_plumbing.api_server prefect server start ARGS...   (--runner ray)

The module named first runs as `python -m MODULE ARGS...` would run it: uvicorn on
prefect.server.api.server:create_app, as Prefect's own temporary server, or Prefect's CLI. Before:

- the server's modules are imported untracked by the cycle collector (runtime/interpreter.py):
  the server answers its first API request ~1.2 s sooner (2 cores), which `mtrl run` waits for;
- every SQLite transaction it opens takes the write lock when it begins (BEGIN IMMEDIATE):
  pipeline/prefect_plumbing/patches.py, begin_transactions_immediately.
"""

import runpy
import sys

from pipeline.prefect_plumbing.patches import begin_transactions_immediately
from runtime.interpreter import untracked_imports

if __name__ == "__main__":
    module = sys.argv.pop(1)
    with untracked_imports():
        import prefect.server.api.server  # noqa: F401
    begin_transactions_immediately()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
