"""Every Prefect internal mtrl relies on (pipeline/prefect_plumbing/patches.py), checked against the
installed Prefect: a release that moves one fails here, naming it, instead of in a run."""

from __future__ import annotations

import ast
import contextvars
import inspect
import json
import os
import subprocess
import sys
import textwrap

from pipeline.prefect_plumbing import patches as prefect_patches


def test_sqlite_transactions_begin_immediately_when_asked_for_update():
    from prefect.server.database.configurations import AioSqliteConfiguration

    begin = AioSqliteConfiguration.begin_transaction
    parameter = inspect.signature(begin).parameters.get("with_for_update")
    assert parameter is not None and parameter.default is False, "begin_transaction lost with_for_update=False"
    source = inspect.getsource(begin)
    assert '"IMMEDIATE" if with_for_update' in source, "with_for_update no longer selects BEGIN IMMEDIATE on SQLite"


def prefects_temporary_server() -> tuple[list[str], dict[str, str]]:
    """The fixed arguments after `python -m` and the environment of Prefect's temporary server,
    read from SubprocessASGIServer._run_uvicorn_command's source."""
    from prefect.server.api.server import SubprocessASGIServer

    tree = ast.parse(textwrap.dedent(inspect.getsource(SubprocessASGIServer._run_uvicorn_command)))
    arguments = next(
        keyword.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg == "args"
    )
    strings = [element.value if isinstance(element, ast.Constant) else None for element in arguments.elts]
    environment = next(
        node.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
    )
    return strings, {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(environment.keys, environment.values)}


def test_the_temporary_server_runs_what_prefect_runs():
    prefect_arguments, prefect_environment = prefects_temporary_server()
    ours = prefect_patches.temporary_server_arguments(port=4321)
    # Prefect's: sys.executable, "-m", then ours; None where Prefect computes a value (the app dir, the port)
    assert prefect_arguments[:2] == [None, "-m"], prefect_arguments
    assert len(prefect_arguments) - 2 == len(ours), (prefect_arguments, ours)
    for theirs, mine in zip(prefect_arguments[2:], ours):
        assert theirs is None or theirs == mine, f"Prefect's temporary server now runs {prefect_arguments}"
    expected = dict(prefect_patches.TEMPORARY_SERVER_ENVIRONMENT)
    expected |= {name: prefect_environment.get(name) for name in prefect_patches.LEFT_OUT_OF_THE_ENVIRONMENT}
    assert prefect_environment == expected, f"Prefect's temporary server now sets {prefect_environment}"


def test_the_database_files_are_where_prefect_keeps_them(tmp_path):
    """Prefect's defaults for a home, read in a fresh process (the test session's own Prefect
    server overrides the database for this one)."""
    code = (
        "import json\nfrom prefect.settings import PREFECT_MEMO_STORE_PATH, get_current_settings\n"
        "url = get_current_settings().server.database.connection_url.get_secret_value()\n"
        "print(json.dumps([url, str(PREFECT_MEMO_STORE_PATH.value())]))"
    )
    environment = {"PREFECT_HOME": str(tmp_path), "PATH": os.environ["PATH"], "DO_NOT_TRACK": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    url, memo = json.loads(done.stdout.strip().splitlines()[-1])
    database, memo_store = prefect_patches.DATABASE_FILES
    assert url == f"sqlite+aiosqlite:///{tmp_path / database}", url
    assert memo == str(tmp_path / memo_store), memo


def test_the_api_client_of_a_context_is_a_context_variable():
    from prefect.client.schemas.objects import FlowRun
    from prefect.context import SyncClientContext

    assert isinstance(SyncClientContext.__var__, contextvars.ContextVar)
    assert "client" in SyncClientContext.model_fields
    assert "parent_task_run_id" in FlowRun.model_fields  # artifacts.sent_before_exit: the outermost flow run
