"""The Prefect API servers mtrl starts, run as Prefect runs them, under a few settings of mtrl's:

    python -m pipeline.prefect_api_server uvicorn ARGS...   (the temporary server)
    python -m pipeline.prefect_api_server prefect server start ARGS...   (--runner ray)

The module named first runs as `python -m MODULE ARGS...` would run it: uvicorn on
prefect.server.api.server:create_app, as Prefect's own temporary server, or Prefect's CLI. Before:

- the server's modules are imported with the garbage collector off: they make a few hundred
  thousand objects that live as long as the server, and collecting while they are made finds
  nothing. Measured on 2 cores: the server answers its first API request in 3.6 s instead of
  4.8 s (mean of four starts each), which is what `mtrl run` waits for before its first flow run;
- every SQLite transaction it opens takes the write lock when it begins (BEGIN IMMEDIATE), as
  Prefect already does for some: see begin_transactions_immediately.
"""

import gc
import runpy
import sys
from typing import Any


def begin_transactions_immediately() -> None:
    """Prefect's server opens most write transactions on SQLite as BEGIN DEFERRED: they read,
    then ask for the write lock. If another connection wrote in between (the server's event
    services record task runs and events while requests arrive), SQLite refuses at once with
    "database is locked" instead of waiting (it would deadlock), the API answers 503, and
    Prefect's client retries after 2 s. In a default `mtrl run` that hit about one run in
    three, on the subflow's tracking task run, and stalled its iteration 1.8-2.5 s. A
    transaction that takes the lock when it begins waits for it instead (SQLite's busy
    timeout, 60 s in Prefect), which is what Prefect's own comment on its SQLite settings
    recommends. Prefect's `with_for_update` flag selects exactly this on SQLite (a row lock
    on PostgreSQL, which this function leaves alone)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    begin_deferred_or_immediate = AioSqliteConfiguration.begin_transaction

    def begin_immediately(self: AioSqliteConfiguration, session: Any, with_for_update: bool = False) -> Any:
        return begin_deferred_or_immediate(self, session, with_for_update=True)

    AioSqliteConfiguration.begin_transaction = begin_immediately


if __name__ == "__main__":
    module = sys.argv.pop(1)
    gc.disable()
    import prefect.server.api.server  # noqa: F401

    gc.freeze()  # what the imports made: left out of every later collection
    gc.enable()
    begin_transactions_immediately()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
