"""verifiers' null harness (its plain chat loop over the MCP tools), run by this environment's python.

The null harness runs its chat program as a PEP 723 script: `uv sync --script` installs the script's
packages at the first rollout of every process, from the network. They are all installed in
.venv-verifiers already (`make setup`), so here the program runs with this interpreter and nothing
is downloaded while mtrl runs.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program


class _InstalledPython:
    """The rollout's runtime, with PEP 723 scripts run by this interpreter instead of uv."""

    def __init__(self, runtime: Any):
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: Any = None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-program-{hashlib.sha256(data).hexdigest()[:16]}.py"  # in the runtime's workdir
        await self._runtime.write(path, data)
        return [sys.executable, path]


class InstalledChatHarness(NullHarness):
    async def setup(self, runtime: Any) -> None:
        pass  # nothing to install

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None) -> Any:
        system_prompt, prompt = self.resolve_prompt(data)
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE,
            self.config,
            ctx,
            trace,
            _InstalledPython(runtime),
            endpoint,
            secret,
            mcp_urls,
            system_prompt,
            prompt,
            extra_args=[f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else (),
        )
