"""The calculator's tool server (MCP): `calculate(expression)`, mtrl's own safe evaluator.

verifiers starts it as `python -m verifiers_calculator.tools` in the rollout's runtime.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import verifiers.v1 as vf

from stages.tools import calculate as evaluate  # stdlib only: importable here without torch

# The tool's parameters as plain JSON schema, as mtrl's calculator task shows them to the model
# (stages.tools.tool_schema): the schema MCP derives from the signature adds pydantic's titles and
# orders the keys otherwise, and the tiny embedded policy only calls the tool it was trained on.
PARAMETERS = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": 'The arithmetic expression to evaluate, for example "12+7-3".',
        }
    },
    "required": ["expression"],
}


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `calculate`, as in mtrl's task, not `calculator_toolset_calculate`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
        try:
            return evaluate(expression)
        except Exception as exc:  # the model reads the error and may try again
            return f"Error: {exc}"

    def register(self, mcp: Any) -> None:
        super().register(mcp)
        mcp._tool_manager.get_tool("calculate").parameters = PARAMETERS  # MCPServer has no public setter


def _stopped(signum: int, frame: Any) -> None:
    """verifiers has the server write its port to /tmp/vf-port-<id> and leaves the file behind; it stops
    the server with SIGTERM (which uvicorn raises again once it has shut down)."""
    if os.environ.get("MCP_PORT_FILE"):
        Path(os.environ["MCP_PORT_FILE"]).unlink(missing_ok=True)
    os._exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped)
    CalculatorToolset.run()
