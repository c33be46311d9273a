"""Generation and PPO-update baseline of mtrl's current engine, against the notebook pattern,
in ONE run on the same model and prompts (the starting point of the GPU-engine work).

    python bench/engine_baseline.py --model tiny  --device cpu   # embedded model, small sizes
    python bench/engine_baseline.py --model qwen3-0.6b --device cuda   # random weights, no download

Workload: R rollouts x T turns x N new tokens (EOS disabled so every row makes N tokens),
with a fixed observation appended after each turn.
- notebook: HF `generate` on the whole left-padded history each turn (lockstep batch).
- mtrl-engine: stages.generate_rollouts.Engine (KV cache kept across turns, per-rollout
  seeded sampling), eager PyTorch.
Also: the PPO-update step (forward + backward + AdamW, chunked logprobs, bf16 autocast on
CUDA) at B x S tokens: tokens/s, MFU against a given peak, peak memory. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from importlib import metadata
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from stages.generate_rollouts import Engine, Request
from stages.ppo_update import token_logprobs


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    if name == "tiny":
        from pipeline.models import EMBEDDED_POLICY, load_model

        return load_model(EMBEDDED_POLICY, "float32", device.type)
    config = Qwen3Config(  # Qwen3-0.6B's shape; random weights cost the same per step
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def notebook_pattern(model, prompts, observation, turns, new_tokens, device) -> tuple[int, float]:
    """Re-encode every rollout's whole history each turn with HF generate (left padding)."""
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    histories = [list(p) for p in prompts]
    generated, started = 0, time.perf_counter()
    for _ in range(turns):
        width = max(len(h) for h in histories)
        ids = torch.zeros((len(histories), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, h in enumerate(histories):
            ids[i, width - len(h) :] = torch.tensor(h)
            mask[i, width - len(h) :] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for i, h in enumerate(histories):
            h += out[i, width:].tolist() + observation
        generated += len(histories) * new_tokens
    synchronize(device)
    return generated, time.perf_counter() - started


def mtrl_engine(model, prompts, observation, turns, new_tokens, device) -> tuple[int, float]:
    """The same workload through the engine: each turn prefills only its new tokens."""
    engine = Engine(model, pad_token_id=0, eos_token_ids=[])
    streams = [list(p) for p in prompts]
    generated, started = 0, time.perf_counter()
    for turn in range(turns):
        requests = [Request(i, s, seed=1000 * turn + i, max_new_tokens=new_tokens) for i, s in enumerate(streams)]
        for i, completion in enumerate(engine.generate(requests, temperature=1.0)):
            streams[i] = streams[i] + completion.token_ids + observation
            generated += len(completion.token_ids)
    synchronize(device)
    return generated, time.perf_counter() - started


def ppo_step(model, batch: int, seq: int, device: torch.device, peak_tflops: float) -> dict:
    """Forward + backward + AdamW on B x S tokens with chunked logprobs (bf16 autocast on CUDA)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(4):
        synchronize(device)
        started = time.perf_counter()
        with autocast:
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            logprobs, _ = token_logprobs(
                hidden[:, :-1].reshape(-1, hidden.shape[-1]),
                model.get_output_embeddings(),
                ids[:, 1:].reshape(-1),
                1.0,
                4096,
            )
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step:  # the first step warms up
            times.append(time.perf_counter() - started)
    seconds = sum(times) / len(times)
    params = sum(p.numel() for p in model.parameters())
    layers, hidden_size = model.config.num_hidden_layers, model.config.hidden_size
    flops = 6 * params * batch * seq + 12 * layers * hidden_size * batch * seq * seq  # + causal attention
    result = {
        "batch": batch,
        "seq": seq,
        "seconds_per_step": round(seconds, 4),
        "tokens_per_second": round(batch * seq / seconds, 1),
    }
    if device.type == "cuda":
        result["mfu"] = round(flops / seconds / (peak_tflops * 1e12), 4)
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    model.eval()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "qwen3-0.6b"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--ppo-batch", type=int, default=4)
    parser.add_argument("--ppo-seq", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 peak of the GPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(args.model, device)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(10, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.rollouts)
    ]
    observation = torch.randint(10, vocab, (16,), generator=generator).tolist()
    work = (prompts, observation, args.turns, args.new_tokens, device)
    notebook_tokens, notebook_seconds = notebook_pattern(model, *work)
    engine_tokens, engine_seconds = mtrl_engine(model, *work)
    report = {
        "benchmark": "engine_baseline",
        "command": "python bench/engine_baseline.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "workload": {
            "rollouts": args.rollouts,
            "turns": args.turns,
            "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens,
        },
        "notebook_tokens_per_second": round(notebook_tokens / notebook_seconds, 1),
        "mtrl_engine_tokens_per_second": round(engine_tokens / engine_seconds, 1),
        "ratio": round((engine_tokens / engine_seconds) / (notebook_tokens / notebook_seconds), 2),
        "ppo_update": ppo_step(model, args.ppo_batch, args.ppo_seq, device, args.peak_tflops),
        "machine": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "platform": platform.platform(),
        },
        "versions": {n: metadata.version(n) for n in ("torch", "transformers")} | {"python": platform.python_version()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
