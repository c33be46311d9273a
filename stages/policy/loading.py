"""Loading the policy: the device, the tokenizer (it must have a chat template), the model, its EOS
tokens, the value head beside it; and which engine's generation logprobs are the policy's own, and
how closely a float32 re-score agrees with logprobs generated in another dtype.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import AfterValidator
from safetensors.torch import load_file, save_file

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model path that cannot be used as a policy, with the reason."""


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


def device_type(device: str) -> str:
    """The device `model.device` picks here ("auto": cuda if present): "cpu" or "cuda"."""
    return pick_device(device).type


# A settings field holding model.device as the device it picks: kernels differ by device, so do the
# numbers, and a stage's version hashes the device it computes on.
Device = Annotated[str, AfterValidator(device_type)]


def exact_generation_logprobs(engine: str, dtype: str) -> bool:
    """Are the logprobs this engine stores the generating policy's own, as a training forward pass
    computes them? Yes for the hf engine in float32 (within 1e-5: tests/test_ppo.py); another engine
    or a low precision samples from a slightly different distribution."""
    return engine == "hf" and dtype == "float32"


# The audit's re-score runs in float32, so logprobs generated in a lower precision differ from it by
# rounding. Measured on the embedded policy (2 iterations x 32 rollouts, every rollout re-scored): up
# to 0.11 in bfloat16, 0.009 in float16, under 1e-4 in float32. The defaults leave about 5x headroom;
# a stale policy or shifted logprobs differ by whole nats.
RESCORE_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.5}


def rescore_tolerance(configured: float | None, generation_dtype: str) -> float:
    """Max |stored - re-scored| logprob (the audit; a vLLM weight update's probe): the configured
    one, else the generating dtype's."""
    return configured if configured is not None else RESCORE_TOLERANCE[generation_dtype]


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Any:
    """The policy's tokenizer; `chat_template` (the text of a Jinja template) replaces its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise ModelError(
            f"{model_dir}: the tokenizer has no chat template; multi-turn rollouts need one "
            "(set model.chat_template: hermes, the tool-calling template mtrl ships for ChatML models, or a file)"
        )
    if tokenizer.eos_token is None:
        raise ModelError(f"{model_dir}: the tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# transformers' from_pretrained changes process-wide state while it builds a model: the default
# dtype, torch.nn.init's functions (no-ops), PreTrainedModel.tie_weights (a no-op). A second thread
# loading at the same time built a model whose tied lm_head stayed on the meta device (measured).
# With ppo.max_staleness the flow prepares the next iteration's batch in a second thread: loads
# take this lock, and so do module initialisations (the value head, LoRA adapters) and the HF
# engine's forward passes, which create tensors under the default dtype.
TRANSFORMERS_GLOBALS = threading.RLock()


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "auto") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with TRANSFORMERS_GLOBALS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
    return model.to(pick_device(device)).eval()


def parameter_count(model_dir: str | Path) -> int:
    """The parameters of a saved model, read from its safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    count = 0
    for path in Path(model_dir).glob("model*.safetensors"):  # one file, or the shards of a large model
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():
                count += math.prod(weights.get_slice(name).get_shape())
    return count


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Tokens that end an assistant turn: the tokenizer's EOS plus the model's generation EOS.
    `model` is the model or its GenerationConfig (an engine that does not load the model)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", model), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return sorted(i for i in ids if i is not None)


class ValueHead(torch.nn.Module):
    """V(s_t) from the policy's last hidden state: one linear layer on the policy's features.

    The features are detached (see forward_targets): the value loss trains the head only,
    never the policy. With the gradient shared, the critic's early, large value loss
    (V = 0 against returns near 1) outweighed the policy gradient in the backbone and the
    policy collapsed within five iterations on guess-number; TRL, verl and OpenRLHF keep
    critic gradients out of the policy too (with a separate critic model)."""

    FILE = "value_head.safetensors"

    def __init__(self, hidden_size: int):
        super().__init__()
        with TRANSFORMERS_GLOBALS:  # torch.nn.init is a no-op while another thread loads a model
            self.linear = torch.nn.Linear(hidden_size, 1)
            torch.nn.init.zeros_(self.linear.weight)
            torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.float())[..., 0]

    @classmethod
    def load(cls, policy_dir: str | Path, hidden_size: int) -> ValueHead:
        """The value head saved beside a policy, or a zero-initialised one (V = 0)."""
        head = cls(hidden_size)
        path = Path(policy_dir) / cls.FILE
        if path.is_file():
            head.load_state_dict(load_file(path))
        return head

    def save(self, policy_dir: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, Path(policy_dir) / self.FILE)
