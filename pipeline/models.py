"""Loading policies: the embedded tiny model, any local HF causal-LM directory, or a hub id."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

EMBEDDED_POLICY = Path(__file__).resolve().parent / "embedded" / "policy"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model path that cannot be used as a policy, with the reason."""


def resolve_model_dir(path: str | None) -> Path:
    """A local directory holding config, weights, tokenizer and chat template."""
    if not path:
        return EMBEDDED_POLICY
    local = Path(path).expanduser()
    if not local.exists():
        if local.is_absolute() or path.startswith(".") or path.count("/") != 1:
            raise ModelError(f"--model {path}: no such directory (and not a hub id of the form org/name)")
        try:  # a hub id, where the machine can reach a hub
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path))
        except Exception as exc:
            raise ModelError(f"--model {path}: not a local directory and the hub download failed: {exc}") from None
    if not (local / "config.json").is_file():
        raise ModelError(f"--model {local}: no config.json; expected a save_pretrained causal-LM directory")
    if not any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelError(f"--model {local}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return local.resolve()


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise ModelError(f"{model_dir}: the tokenizer has no chat template; multi-turn rollouts need one")
    if tokenizer.eos_token is None:
        raise ModelError(f"{model_dir}: the tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "auto") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
    return model.to(pick_device(device)).eval()


def eos_token_ids(tokenizer: Any, model: torch.nn.Module) -> list[int]:
    """Tokens that end an assistant turn: the tokenizer's EOS plus the model's generation EOS."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return sorted(i for i in ids if i is not None)
