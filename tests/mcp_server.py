"""A real MCP tool server for the tests, written with FastMCP as users write theirs: a tool that
works, one that raises, one that hangs (it writes its process id first) and one that crashes its
server. MCP_TEST_SERVER_VERSION sets the version the server reports.

    python tests/mcp_server.py      (stdio)
"""

import os
import time

from fastmcp import FastMCP

server = FastMCP("mtrl-test-tools", version=os.environ.get("MCP_TEST_SERVER_VERSION", "1.0.0"))


@server.tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@server.tool
def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: What to fail with.
    """
    raise RuntimeError(f"exploded: {reason}")


@server.tool
def hang(pid_file: str) -> str:
    """Write this server's process id to a file, then never answer.

    Args:
        pid_file: Where to write the process id.
    """
    with open(pid_file, "w") as out:
        out.write(str(os.getpid()))
    time.sleep(3600)
    return "woke up"


@server.tool
def crash() -> str:
    """End the server's process, as a crash in a native library would."""
    os._exit(7)


if __name__ == "__main__":
    server.run(transport="stdio", show_banner=False)
