"""Build the embedded tiny model offline: a byte-level BPE tokenizer in Qwen's style, a
~1M-parameter Qwen3 model, a supervised warm-start on the calculator task, and a short
"noisy" fine-tune that makes the policy often wrong so that RL has room to improve.

    python -m pipeline.cli.embedded_build tokenizer            # -> pipeline/models/embedded/tokenizer/
    python -m pipeline.cli.embedded_build expert --seed 0      # SFT from scratch -> expert/
    python -m pipeline.cli.embedded_build policy               # noisy fine-tune of expert/ -> policy/

Why two checkpoints are committed: a tiny model learns the
tool-call *format* quickly, but copying the expression correctly appears through a sharp,
seed-dependent phase transition. Retraining in CI is therefore not reliable, so the expert
checkpoint is committed with the command that produced it, and the imperfect starting policy
is a short, deterministic fine-tune of it that mixes in flawed episodes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pipeline.models.base_model import EMBEDDED_POLICY, SHIPPED_TEMPLATES
from stages.environments import ENVIRONMENTS, CalculatorEnv
from stages.registry import Tasks, tool_schemas
from stages.tools import TOOLS, calculate

EMBEDDED = EMBEDDED_POLICY.parent  # pipeline/models/embedded/: what this script writes, and mtrl ships
TOKENIZER_DIR = EMBEDDED / "tokenizer"
EXPERT_DIR = EMBEDDED / "expert"
POLICY_DIR = EMBEDDED / "policy"

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# As in Qwen3 these are ordinary added tokens (kept by skip_special_tokens=True).
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2/3 pre-tokenizer regex: one digit per token, which suits arithmetic.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENGLISH = (
    "I am thinking of a number between 1 and 100. Guess it; I will say higher or lower.",
    "The number is higher. The number is lower. Correct, you found it in few turns.",
    "What is the weather in Paris, London, Tokyo, Berlin, Madrid, Rome, New York or Sydney?",
    "The temperature is 21 degrees celsius and sunny; tomorrow it is cloudy with rain and wind.",
    "Convert the temperature to fahrenheit and compute the difference between the two cities.",
    "The tool returned an error: the arguments are invalid, the tool is unknown, or it timed out.",
    "Please answer with a single number. The answer is wrong. The result is correct.",
    "Let me think step by step about the question before I call a tool or give the answer.",
)


def chat_template() -> str:
    return SHIPPED_TEMPLATES["hermes"].read_text()


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(out_dir: Path = TOKENIZER_DIR, seed: int = 0) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.utils.chat_template_utils import render_jinja_template

    env, rng = CalculatorEnv(), random.Random(seed)
    conversations = [env.demonstration(env.sample_task(rng)) for _ in range(3000)]
    corpus, _ = render_jinja_template(conversations, tools=tool_schemas(env, TOOLS), chat_template=chat_template())
    corpus += list(ENGLISH) * 50

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: never UNK
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = chat_template()
    hf.save_pretrained(out_dir)
    return hf


# ----------------------------------------------------------------------------- episodes


def corrupt(expr: str, rng: random.Random) -> str:
    """The expression with one digit changed: a plausible copying mistake."""
    positions = [i for i, ch in enumerate(expr) if ch.isdigit()]
    i = rng.choice(positions)
    digit = rng.choice([d for d in "123456789" if d != expr[i]])  # never a leading zero
    return expr[:i] + digit + expr[i + 1 :]


def flawed_demonstration(env: CalculatorEnv, task: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    """An episode with one realistic mistake: guessing without the tool, or copying badly."""
    expr, answer = task["expression"], task["answer"]
    if rng.random() < 0.6:  # answer without calling the tool
        guess = answer + rng.choice([-1, 1]) * rng.randint(1, 20)
        return env.reset(task) + [
            {
                "role": "assistant",
                "content": f"The result is {guess}.",
                "reasoning_content": f"The user wants {expr}. I can answer directly.",
            }
        ]
    wrong = corrupt(expr, rng)
    episode = env.demonstration({**task, "expression": wrong, "answer": int(calculate(wrong))})
    episode[1] = env.reset(task)[1]  # the question still asks about the original expression
    return episode


def encode_batch(tokenizer, conversations) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside assistant tokens) of
    (messages, tools) pairs."""
    encoded = [
        tokenizer.apply_chat_template(messages, tools=tools, return_assistant_tokens_mask=True, return_dict=True)
        for messages, tools in conversations
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        attention[row, :n] = 1
        mask = torch.tensor(e["assistant_masks"], dtype=torch.bool)
        labels[row, :n] = torch.where(mask, ids[row, :n], -100)
    return ids, attention, labels


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model, tokenizer, n: int = 64, temperature: float = 1.0, seed: int = 1234, tasks: tuple[str, ...] = ("calculator",)
) -> dict[str, float]:
    """Run each task's episodes on n fixed tasks with the real rollout code. calculator:
    well-formed first call, first call computing the answer, correct final answer;
    guess-number: solved within 50 turns, mean turns to solve; weather: correct answer."""
    from pipeline.orchestration.episodes import run_episodes
    from schemas.config import RunConfig
    from stages.assign_rewards import rollout_metrics
    from stages.generate_rollouts.hf import HFEngine
    from stages.policy.loading import eos_token_ids

    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    results: dict[str, float] = {}
    for task in tasks:
        max_turns = {"calculator": 3, "guess-number": 50, "weather": 4}[task]
        config = RunConfig(
            seed=seed,
            task={"name": task, "rollouts": n, "group_size": 1, "max_turns": max_turns},
            generation={"temperature": temperature},
        )
        turns = run_episodes(engine, tokenizer, config)
        metrics = rollout_metrics(turns, Tasks.resolve(config).environments(), config.task.max_turns)
        prefix = "" if task == "calculator" else f"{task}/"
        results[f"{prefix}success_rate"] = metrics["success_rate"]
        if task == "calculator":
            first = turns.filter(lambda row: row["turn"] == 0, keep_in_memory=True)
            calls, payloads = first["tool_calls"], first["task_payload"]
            results["tool_call_rate"] = sum(bool(c) and all(x["failure_kind"] is None for x in c) for c in calls) / n
            results["right_call_rate"] = (
                sum(any(x["result"] == str(json.loads(p)["answer"]) for x in c) for c, p in zip(calls, payloads)) / n
            )
        if task == "guess-number":
            results["guess-number/mean_turns_to_solve"] = metrics["mean_turns_to_solve"]
            results["guess-number/mean_turns_to_solve_or_limit"] = metrics["mean_turns_to_solve_or_limit"]
            results["guess-number/mean_turns"] = metrics["mean_turns"]
    return results


# ----------------------------------------------------------------------------- training


def train(
    model,
    tokenizer,
    make_conversation,
    *,
    steps: int,
    lr: float,
    warmup: int,
    batch_size: int,
    seed: int,
    eval_every: int,
    log: list[dict[str, Any]],
    eval_tasks: tuple[str, ...] = ("calculator",),
) -> None:
    """SFT on make_conversation(rng) -> (messages, tools), loss on assistant tokens only."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = time.time()
    for step in range(1, steps + 1):
        model.train()
        ids, attention, labels = encode_batch(tokenizer, [make_conversation(rng) for _ in range(batch_size)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % eval_every == 0 or step == steps:
            model.eval()
            row = {"step": step, "loss": round(loss.item(), 4), "train_s": round(time.time() - start, 1)}
            row.update(evaluate(model, tokenizer, tasks=eval_tasks))
            log.append(row)
            print(json.dumps(row), flush=True)


def save(model, tokenizer, out_dir: Path, info: dict[str, Any]) -> None:
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # A rebuild is bit-identical only on the same software stack: record it.
    software = {name: metadata.version(name) for name in ("torch", "transformers", "tokenizers")}
    info = {**info, "software": {**software, "python": platform.python_version()}}
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")


def build_expert(seed: int, steps: int, out_dir: Path) -> None:
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    env = CalculatorEnv()
    tools = tool_schemas(env, TOOLS)
    log: list[dict[str, Any]] = []
    train(
        model,
        tokenizer,
        lambda rng: (env.demonstration(env.sample_task(rng)), tools),
        steps=steps,
        lr=3e-3,
        warmup=30,
        batch_size=16,
        seed=seed,
        eval_every=100,
        log=log,
    )
    info = {"command": f"build expert --seed {seed} --steps {steps}", "log": log}
    save(model, tokenizer, out_dir, {**info, "final_evaluation": evaluate(model, tokenizer, n=256)})


TASK_MIX = (("calculator", 0.45), ("guess-number", 0.35), ("weather", 0.2))  # shares of SFT episodes
ALL_TASKS = tuple(name for name, _ in TASK_MIX)


def build_policy(seed: int, steps: int, flawed_fraction: float, in_dir: Path, out_dir: Path) -> None:
    """Fine-tune the calculator expert on a mix of tasks: calculator episodes, flawed with
    probability flawed_fraction; guess-number searches that guess the midpoint half of the
    time and a random number inside the bounds otherwise; correct weather episodes."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(in_dir)
    model = Qwen3ForCausalLM.from_pretrained(in_dir, dtype=torch.float32)
    environments = {name: ENVIRONMENTS[name] for name in ALL_TASKS}
    tools = {name: tool_schemas(env, TOOLS) for name, env in environments.items()}

    def conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        name = rng.choices([n for n, _ in TASK_MIX], weights=[w for _, w in TASK_MIX])[0]
        env = environments[name]
        task = env.sample_task(rng)
        if name == "calculator":
            flawed = rng.random() < flawed_fraction
            return (flawed_demonstration(env, task, rng) if flawed else env.demonstration(task)), tools[name]
        if name == "guess-number":
            return env.demonstration(task, rng), tools[name]
        return env.demonstration(task), tools[name]

    log: list[dict[str, Any]] = [{"step": 0, **evaluate(model, tokenizer, tasks=ALL_TASKS)}]
    print(json.dumps(log[0]), flush=True)
    train(
        model,
        tokenizer,
        conversation,
        steps=steps,
        lr=1e-3,
        warmup=10,
        batch_size=16,
        seed=seed,
        eval_every=100,
        log=log,
        eval_tasks=ALL_TASKS,
    )
    command = f"build policy --seed {seed} --steps {steps} --flawed-fraction {flawed_fraction}"
    final = evaluate(model, tokenizer, n=256, tasks=("calculator",)) | evaluate(
        model, tokenizer, n=64, tasks=ALL_TASKS[1:]
    )
    save(model, tokenizer, out_dir, {"command": command, "log": log, "final_evaluation": final})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["tokenizer", "expert", "policy"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="expert: 1000, policy: 400")
    parser.add_argument("--flawed-fraction", type=float, default=0.7, help="policy: share of flawed episodes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "tokenizer":
        build_tokenizer(args.out or TOKENIZER_DIR)
    elif args.what == "expert":
        build_expert(args.seed, args.steps or 1000, args.out or EXPERT_DIR)
    else:
        build_policy(args.seed, args.steps or 400, args.flawed_fraction, EXPERT_DIR, args.out or POLICY_DIR)


if __name__ == "__main__":
    main()
