"""The calculator task as a verifiers 0.4 environment, trained through mtrl: each rollout is one
rollout of examples/agents/verifiers_calculator run by verifiers itself, its model calls made by
verifiers' train client (token ids in and out) on the mtrl rollout's endpoint.

    make setup    # .venv-verifiers: verifiers needs openai<3, mtrl's environment has openai 3
    mtrl run --agent examples.agents.verifiers_agent:agent

The train client renders every prompt to token ids itself, with the policy's tokenizer and the qwen3
renderer of the `renderers` package (the embedded policy's template renders Qwen3's format: ChatML,
Hermes <tool_call> JSON, tool results as a user turn of <tool_response> blocks), and posts them to
{base without /v1}/inference/v1/generate; its next call's ids continue the last call's prompt and
completion. verifiers runs offline: its subprocess runtime, its chat loop run by .venv-verifiers'
python (nothing installed at run time), HF_HUB_OFFLINE=1, nothing pushed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
TOKENIZER = REPO / "pipeline" / "models" / "embedded" / "policy"  # the embedded policy's tokenizer files
RENDERER = {"name": "qwen3"}  # renders the policy's chat template (enable_thinking on, mtrl's default)
MAX_TURNS = 4  # the calculator's turn limit: mtrl refuses calls past it
TIMEOUT_S = 240.0  # one verifiers rollout, start-up included (below mtrl's agent.timeout_s)
STOP_S = 10.0  # after SIGTERM, how long verifiers may take to stop its tool server and chat loop
LOG_VARIABLE = "MTRL_VERIFIERS_LOG"  # set: the file each rollout's outcome is appended to (JSON lines)


def verifiers_python() -> Path:
    if not PYTHON.exists():
        raise RuntimeError(f"{PYTHON} is missing: run `make setup` (it builds .venv-verifiers)")
    return PYTHON


async def agent(rollout) -> float:
    """Run one verifiers rollout of this rollout's task; its reward (the environment's @vf.reward)."""
    system = next((m["content"] for m in rollout.messages if m.get("role") == "system"), None)
    spec = {
        "base_url": rollout.base_url,
        "api_key": rollout.api_key,
        "model": rollout.model,
        "tokenizer": str(TOKENIZER),
        "renderer": RENDERER,
        "question": rollout.task["question"],
        "answer": rollout.task["answer"],
        "system_prompt": system,
        "max_turns": MAX_TURNS,
        "spawned_at": time.time(),
    }
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "examples" / "agents"), str(REPO)]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    # Not a new session: mtrl ends the agents' process group, this process with it.
    process = await asyncio.create_subprocess_exec(
        str(verifiers_python()),
        "-m",
        "verifiers_calculator.rollout",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
        cwd=REPO,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(json.dumps(spec).encode()), TIMEOUT_S)
    except TimeoutError:
        await _stop(process)
        raise TimeoutError(f"the verifiers rollout did not finish within {TIMEOUT_S:g} s") from None
    except BaseException:  # mtrl cancelled the agent (its own deadline)
        await _stop(process)
        raise
    lines = stdout.decode().strip().splitlines()
    if process.returncode != 0 or not lines:
        tail = stderr.decode(errors="replace").strip()[-1500:]
        raise RuntimeError(f"the verifiers rollout exited with code {process.returncode}: {tail}")
    result = json.loads(lines[-1])
    if os.environ.get(LOG_VARIABLE):  # one line per rollout: its reward, turns and timing
        with open(os.environ[LOG_VARIABLE], "a") as log:
            log.write(json.dumps({"rollout_id": rollout.rollout_id, **result}) + "\n")
    if not result["ok"] or result["reward"] is None:
        raise RuntimeError(f"the verifiers rollout failed ({result['stop_condition']}): {result['errors']}")
    return float(result["reward"])


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)  # the rollout script cancels its rollout: verifiers cleans up
    try:
        await asyncio.wait_for(process.wait(), STOP_S)
    except TimeoutError:
        process.kill()
        await process.wait()
