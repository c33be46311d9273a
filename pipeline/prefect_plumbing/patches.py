"""Every place where mtrl relies on Prefect's internals, in one module (Prefect is pinned to 3.8:
pyproject.toml). tests/test_prefect_patches.py checks each one against the installed Prefect and
fails, naming it, when a release moves what it relies on.

1. begin_transactions_immediately (applied by pipeline/prefect_plumbing/api_server.py in the servers mtrl
   starts): Prefect's server opens most write transactions on SQLite as BEGIN DEFERRED: they
   read, then ask for the write lock. If another connection wrote in between (the server's
   event services record task runs and events while requests arrive), SQLite refuses at once
   with "database is locked" instead of waiting (it would deadlock), the API answers 503, and
   Prefect's client retries after 2 s. In a default `mtrl run` that hit about one run in three,
   on the subflow's tracking task run, and stalled its iteration 1.8-2.5 s. A transaction that
   takes the lock when it begins waits for it instead (SQLite's busy timeout, 60 s in Prefect),
   which Prefect's own comment on its SQLite settings recommends. Prefect's `with_for_update`
   flag selects exactly this on SQLite (a row lock on PostgreSQL, which this leaves alone).
2. temporary_server_arguments and TEMPORARY_SERVER_ENVIRONMENT: what Prefect runs as its
   temporary server (prefect.server.api.server.SubprocessASGIServer._run_uvicorn_command), which
   mtrl runs itself, so that it starts before `import prefect` (pipeline/prefect_plumbing/servers.py).
   PREFECT__SERVER_EPHEMERAL is a private variable of Prefect's. Prefect also sets
   PREFECT__SERVER_FINAL, left out here on purpose: with FastAPI >= 0.137 all it does is one more
   full garbage collection while the server starts, which mtrl waits for.
3. DATABASE_FILES: the files of a Prefect home's SQLite database (the default database URL's
   file and the memo of registered block types), which mtrl copies from a migrated template.
4. call_with_own_client (pipeline/monitoring/artifacts.py): an API call made through a client of the
   caller's own, by setting Prefect's SyncClientContext context variable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMPORARY_SERVER_ENVIRONMENT = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"}
LEFT_OUT_OF_THE_ENVIRONMENT = ("PREFECT__SERVER_FINAL",)  # what Prefect sets that mtrl does not (see 2.)
DATABASE_FILES = ("prefect.db", "memo_store.toml")


def begin_transactions_immediately() -> None:
    """Every SQLite transaction of this process's Prefect server takes the write lock as it
    begins (see 1. above)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    begin_deferred_or_immediate = AioSqliteConfiguration.begin_transaction

    def begin_immediately(self: AioSqliteConfiguration, session: Any, with_for_update: bool = False) -> Any:
        return begin_deferred_or_immediate(self, session, with_for_update=True)

    AioSqliteConfiguration.begin_transaction = begin_immediately


def temporary_server_arguments(port: int) -> list[str]:
    """`-m uvicorn ...` as Prefect runs its temporary server: the API app, no UI, on 127.0.0.1:port
    (without `python`: pipeline/prefect_plumbing/servers.py runs it through mtrl's launcher)."""
    prefect_parent = Path(importlib.util.find_spec("prefect").origin).parent.parent  # no `import prefect` here
    return [
        "uvicorn",
        "--app-dir", str(prefect_parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "error",
        "--lifespan", "on",
    ]  # fmt: skip


_own_clients: dict[str, Any] = {}  # url -> an open SyncClientContext, for the process's life


def call_with_own_client(url: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call` (one of Prefect's API helpers, which take the client of the current
    SyncClientContext) through this process's own client for `url`, open until the process exits,
    not the current run's (which closes when its run ends). Run it in a copied context: the
    context variable set here must not reach the caller's."""
    from prefect.context import SyncClientContext

    if url not in _own_clients:
        SyncClientContext.__var__.set(None)  # not the run's client: a new one
        _own_clients[url] = SyncClientContext()
        _own_clients[url].client.__enter__()
    SyncClientContext.__var__.set(_own_clients[url])
    return call(*args, **kwargs)
