"""MCP tool servers (tools.mcp_servers): their tools become tools (docs/environments.md).

At run start each configured server is started (a command, over stdio) or reached (a URL, over
streamable HTTP), initialised and asked for its tools. Their names, descriptions and input
schemas are shown to the model as Hermes tools of the tasks that name them, and a call keeps the
guarantees of mtrl's own tools (stages/execute_tools/calls.py):

- a deadline (tools.timeout_s): a call that overruns it answers a timeout error at once; a stdio
  server is then shut down (MCP's sequence: its stdin closed, its process group SIGTERMed after
  2 s and SIGKILLed 2 s later) and a new one serves the next call; a call to a URL is abandoned
  (a server you run is yours to stop);
- an output cap (tools.max_output_chars), marked;
- arguments that do not fit the schema, a tool that raises or answers is_error: an error the
  model reads (bad_arguments, raised);
- a server that dies during a call or cannot start mid-run: `crashed`, which fails the rollout,
  with the end of the server's stderr;
- a server that cannot start at run start refuses the run.

Each call to a stdio server holds one server process alone (a pool, started once and reused),
so a call that hangs never takes another down, and tools must not keep state from one call to
the next. Every process is started through runtime/processes.py and dies with mtrl (SIGKILL
included). The sessions live on one asyncio loop in a daemon thread, `mtrl-mcp`: the thread the
kernel watches for those processes, alive as long as this process.

What identifies a tool (the server's command or URL, its name and version, the tool's schema, the
version of `mcp` and of this file) enters the versions of the stages it shapes
(stages/registry.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from importlib import metadata
from pathlib import Path
from typing import Any

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from runtime.hashing import source_version
from runtime.processes import dies_with_this_thread
from schemas.config import MCPServerConfig
from stages.tools import RemoteTool, truncate

STDERR_TAIL_CHARS = 800  # how much of a dead server's stderr an error quotes


class ServerError(RuntimeError):
    """An MCP server that could not start, or is gone."""


@functools.cache
def event_loop() -> asyncio.AbstractEventLoop:
    """The loop every MCP session of this process lives on, in its own daemon thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="mtrl-mcp", daemon=True).start()
    return loop


def wait_for(coroutine: Any, timeout_s: float) -> Any:
    """Run a coroutine on the loop from another thread; TimeoutError (it is cancelled) past timeout_s."""
    future: Future = asyncio.run_coroutine_threadsafe(coroutine, event_loop())
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


class Connection:
    """One initialised client session with a server; for a stdio server, its own process."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        self.stderr = tempfile.TemporaryFile() if config.command else None
        self.session: ClientSession | None = None
        self.initialized: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._closing = asyncio.Event()
        asyncio.run_coroutine_threadsafe(self._hold(), event_loop())
        if not self._ready.wait(config.start_timeout_s):
            self.close()
            raise ServerError(f"no answer to initialize within {config.start_timeout_s:g} s{self.stderr_tail()}")
        if self.session is None:
            error = self.error
            while isinstance(error, BaseExceptionGroup) and error.exceptions:  # an anyio task group's wrapping
                error = error.exceptions[0]
            raise ServerError(f"{error.__class__.__name__}: {error}{self.stderr_tail()}")

    def _transport(self) -> Any:
        if self.config.url is not None:
            return streamable_http_client(self.config.url)
        command = dies_with_this_thread(list(self.config.command), signal.SIGKILL)  # no handler can refuse it
        parameters = StdioServerParameters(command=command[0], args=command[1:], env=self.config.env or None)
        return stdio_client(parameters, errlog=self.stderr)

    async def _hold(self) -> None:
        """Open the session, and keep it open until close() (the transport's exit stops a stdio server)."""
        try:
            async with self._transport() as (read, write), ClientSession(read, write) as session:
                self.initialized = await session.initialize()
                self.session = session
                self._ready.set()
                await self._closing.wait()
        except BaseException as exc:  # reported to whoever waits for the session
            self.error = exc
        finally:
            self.session = None
            self._ready.set()

    def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        session = self.session
        if session is None:
            raise ServerError(f"the server is gone{self.stderr_tail()}")
        if self.stderr is not None:
            # each call starts an empty stderr file, so a crash is quoted with what this call wrote; the
            # server shares the file's offset (an inherited descriptor), so both go back to 0
            os.ftruncate(self.stderr.fileno(), 0)
            os.lseek(self.stderr.fileno(), 0, os.SEEK_SET)
        return wait_for(session.call_tool(tool, arguments), timeout_s)

    def close(self) -> None:
        event_loop().call_soon_threadsafe(self._closing.set)

    def stderr_tail(self) -> str:
        """'; its stderr ends with: ...' for a stdio server that wrote something, else ''."""
        if self.stderr is None:
            return ""
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        end = os.pread(fd, 4 * STDERR_TAIL_CHARS, max(0, size - 4 * STDERR_TAIL_CHARS))  # the offset stays
        tail = end.decode(errors="replace").strip()[-STDERR_TAIL_CHARS:]
        return f"; its stderr ends with:\n{tail}" if tail else ""


class Server:
    """A configured server: what it says it is, its tools, and its idle connections."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        first = Connection(config)
        info = first.initialized.server_info
        self.info = {"name": info.name, "version": info.version}
        try:
            self.tools = wait_for(first.session.list_tools(), config.start_timeout_s).tools
        except Exception as exc:
            first.close()
            raise ServerError(f"tools/list failed: {exc.__class__.__name__}: {exc}{first.stderr_tail()}") from None
        self._idle = [first]
        self._lock = threading.Lock()

    def acquire(self) -> Connection:
        """A connection for one call: an idle one, or a new one (a new process for a stdio
        server). All calls to a URL share one session."""
        with self._lock:
            self._idle = [connection for connection in self._idle if connection.session is not None]  # live ones
            if self._idle:
                return self._idle[0] if self.config.url is not None else self._idle.pop()
        return Connection(self.config)

    def release(self, connection: Connection) -> None:
        with self._lock:
            if connection.session is not None and connection not in self._idle:
                self._idle.append(connection)

    def discard(self, connection: Connection) -> None:
        """After a timeout or a failure: a stdio server is shut down; a URL's session is kept
        for the next call if it still stands."""
        if self.config.url is None:
            connection.close()


class MCPTool(RemoteTool):
    """One tool of one server."""

    def __init__(self, server: Server, tool: Any) -> None:
        self.server, self.name = server, tool.name
        parameters = tool.input_schema or {"type": "object", "properties": {}}
        self.schema = {"type": "function", "function": {"name": tool.name, "description": tool.description or ""}}
        self.schema["function"]["parameters"] = parameters
        where = {"url": server.config.url} if server.config.url else {"command": server.config.command}
        self.identity = {
            "server": server.config.name,
            **where,
            "server_info": server.info,
            "schema": self.schema,
            "client": {"mcp": metadata.version("mcp"), "code": source_version(Path(__file__))},
        }
        self.start_timeout_s = server.config.start_timeout_s

    def call(self, arguments: dict[str, Any], timeout_s: float, max_chars: int) -> tuple[str, str | None]:
        label = f"MCP server '{self.server.config.name}'"
        try:
            connection = self.server.acquire()
        except ServerError as exc:
            return truncate(f"Error: {label} could not start for tool '{self.name}': {exc}", max_chars), "crashed"
        try:
            result = connection.call(self.name, arguments, timeout_s)
        except TimeoutError:
            self.server.discard(connection)
            return f"Error: tool '{self.name}' timed out after {timeout_s:g} s", "timeout"
        except Exception as exc:  # the connection closed under the call: the server died
            self.server.discard(connection)
            problem = f"{exc.__class__.__name__}: {exc}{connection.stderr_tail()}"
            return truncate(f"Error: {label} failed during tool '{self.name}' ({problem})", max_chars), "crashed"
        self.server.release(connection)
        text = content_text(result)
        if result.is_error:
            return truncate(f"Error: {text}", max_chars), "raised"
        return truncate(text, max_chars), None


def content_text(result: Any) -> str:
    """What a tool result says, as text: its text parts (others named by type), or its structured content."""
    parts = [
        item.text if getattr(item, "text", None) is not None else f"[{item.type} content]" for item in result.content
    ]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, sort_keys=True))
    return "\n".join(parts)


@functools.lru_cache(maxsize=16)
def served_tools(servers_json: str) -> dict[str, MCPTool]:
    """The tools of these servers (tools.mcp_servers as JSON), by name; each server started or
    reached once per process. A server that cannot start, or two that serve the same tool name,
    is a ValueError."""
    tools: dict[str, MCPTool] = {}
    for config in (MCPServerConfig.model_validate(entry) for entry in json.loads(servers_json)):
        where = f"url {config.url}" if config.url else f"command {config.command}"
        try:
            server = Server(config)
        except ServerError as exc:
            raise ValueError(f"MCP server '{config.name}' ({where}) cannot start: {exc}") from None
        for tool in server.tools:
            if tool.name in tools:
                other = tools[tool.name].server.config.name
                raise ValueError(f"MCP servers '{other}' and '{config.name}' both serve a tool '{tool.name}'")
            tools[tool.name] = MCPTool(server, tool)
    return tools
