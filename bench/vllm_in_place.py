"""Is an in-place weight update exact on a real model? A vLLM server started on one checkpoint
loads another in place (mtrl's worker extension); a second server is started on that other
checkpoint; both sample the same 8 requests (same seeds).

    python bench/vllm_in_place.py FROM_POLICY TO_POLICY [--out FILE.json]

FROM/TO: two policy folders of one model (e.g. a runs dir's imported model and a policy RL trained
from it: bench/real_model.py's SmolLM2-135M run). Reports each way in (seconds, the probe's
verification against an HF float32 recompute) and whether the in-place server gives the fresh
server's tokens and logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from runtime.vllm_server import vllm_version
from schemas.config import RunConfig
from schemas.token_stream import prompt_token_ids
from stages.generate_rollouts.engine import EngineSettings, Request, Sampling, open_engine
from stages.policy.loading import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench/results/vllm_in_place_smollm2_cpu.json"))
    args = parser.parse_args()
    config = RunConfig(
        generation={"engine": "vllm", "max_new_tokens": 64, "max_context_tokens": 2048, "enable_thinking": False},
        store={"runs_dir": tempfile.mkdtemp(prefix="mtrl-in-place-")},
    )
    settings = EngineSettings.resolve(config)
    tokenizer = load_tokenizer(args.target)
    prompt = prompt_token_ids(
        tokenizer, [{"role": "user", "content": "What is 12 * 7? Use the calculator."}], [], False
    )
    requests = [Request(i, prompt, 1000 + i, 48) for i in range(8)]

    engine = open_engine(args.source, tokenizer, settings)
    started = engine.update
    engine.load_policy(args.target)
    in_place, in_place_update = engine.generate(requests, Sampling(1.0)).completions, engine.update
    engine.close()
    fresh = open_engine(args.target, tokenizer, settings)
    restarted, fresh_update = fresh.generate(requests, Sampling(1.0)).completions, fresh.update
    fresh.close()

    same = [a.token_ids == b.token_ids for a, b in zip(in_place, restarted)]
    differences = [abs(x - y) for a, b in zip(in_place, restarted) for x, y in zip(a.logprobs, b.logprobs)]
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "vllm": vllm_version(None, None)},
        "source": str(args.source),
        "target": str(args.target),
        "server_start_on_source": started,
        "in_place_to_target": in_place_update,
        "server_start_on_target": fresh_update,
        "requests_with_the_same_tokens": f"{sum(same)} of {len(same)}",
        "max_abs_logprob_difference_in_place_vs_fresh": max(differences),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
