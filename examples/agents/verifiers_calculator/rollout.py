"""One rollout of the calculator environment against an OpenAI-compatible endpoint that serves token
ids (POST {base without /v1}/inference/v1/generate), with verifiers' train client: it renders every
prompt with the policy's tokenizer and a renderer itself, and reads the sampled token ids back.

    python -m verifiers_calculator.rollout < spec.json     (examples/agents on PYTHONPATH)

spec: {"base_url" (ends with /v1), "api_key", "model", "tokenizer" (a local folder), "renderer" (a
renderers config: {"name": "qwen3"}), "question", "answer", "system_prompt", "max_turns", and
"spawned_at" (time.time() when the caller started this process, for the timing)}. Prints one JSON
line: {"reward", "ok", "turns", "stop_condition", "errors", "timing"}; the timing in seconds.
Offline: the subprocess runtime, a local tokenizer, nothing pushed (HF_HUB_OFFLINE=1 is the
caller's). SIGTERM cancels the rollout: verifiers stops its tool server and chat program.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import verifiers.v1 as vf
from verifiers.v1.env import RunSlot
from verifiers.v1.utils.loaders import load_environment, resolve_env_config

IMPORTED = time.time()  # python started and verifiers imported (this package's __init__ imports it)
TASKSET_ID = "verifiers_calculator"
KEY_VARIABLE = "MTRL_ROLLOUT_KEY"  # the train client reads its API key from a variable


async def run(spec: dict) -> dict:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    os.environ[KEY_VARIABLE] = spec["api_key"]
    config = resolve_env_config(
        {
            "taskset": {
                "id": TASKSET_ID,
                "question": spec["question"],
                "answer": spec["answer"],
                "system_prompt_text": spec.get("system_prompt"),
            },
            "agent": {"runtime": {"type": "subprocess"}, "max_turns": spec.get("max_turns")},
        }
    )
    env = load_environment(config)
    client = vf.TrainClientConfig(
        base_url=spec["base_url"],
        api_key_var=KEY_VARIABLE,
        renderer=spec.get("renderer", {"name": "qwen3"}),
        renderer_model_name=spec["tokenizer"],
    )
    context = vf.ModelContext(client=client, model=spec["model"], sampling=vf.SamplingConfig())
    (task,) = list(env.taskset)
    async with env.serving():  # the tool server and the interception server
        served = time.time()
        episode = await env.run_slot(RunSlot(task), context)
        ran = time.time()
    end = time.time()
    trace = episode.traces[0] if episode.traces else None
    errors = [f"{error.type}: {error.message}" for error in episode.errors]
    errors += [f"{error.type}: {error.message}" for error in (trace.errors if trace else [])]
    model_s = trace.timing.agent.model.duration if trace else 0.0
    spawned = spec.get("spawned_at", IMPORTED)
    return {
        "reward": trace.reward if trace is not None else None,
        "ok": episode.ok,
        "turns": trace.num_turns if trace is not None else 0,
        "stop_condition": trace.stop_condition if trace is not None else None,
        "errors": errors,
        "timing": {
            "python_and_imports": IMPORTED - spawned,
            "environment_and_tool_server": served - IMPORTED,
            "rollout": ran - served,  # the chat program's start, its model and tool calls, the scoring
            "model": model_s,  # waiting for the endpoint
            "teardown": end - ran,
            "total": end - spawned,
            "startup": end - spawned - model_s,  # everything but the model calls
        },
    }


if __name__ == "__main__":
    result = asyncio.run(run(json.loads(sys.stdin.read())))
    print(json.dumps(result), flush=True)
