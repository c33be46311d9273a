"""The token-stream contract: how a rollout's tokens grow turn by turn.

Token-in-token-out: the model's context is never re-rendered from text. It starts as the
chat-template rendering of the initial messages plus the generation prompt; each turn then
appends the sampled completion (ending in the EOS token <|im_end|>), the *delta* tokens
the chat template would add for the observation messages (tool results or environment
replies), and the generation prompt of the next assistant turn. Deltas are taken from the
model's own chat template, so any template in the Hermes/Qwen family works.

Convention recorded in manifests: earlier turns keep their <think> blocks exactly as sampled
(Qwen3's template would drop them when re-rendering history; we never re-render).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

CONTEXT_CONVENTION = "sampled-tokens; history never re-rendered; earlier <think> blocks kept"
# Deltas are rendered after a placeholder user message: templates such as Qwen3's re-render
# earlier *assistant* turns when messages follow them, but never an earlier user turn.
_PLACEHOLDER_USER = [{"role": "user", "content": "q"}]
_PLACEHOLDER_ASSISTANT = {"role": "assistant", "content": "a", "reasoning_content": "r"}


def chat_template_hash(tokenizer: Any) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, enable_thinking: bool
) -> list[int]:
    """The first context of a rollout: initial messages + the assistant generation prompt."""
    text = _render(tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    return _encode(tokenizer, text)


@functools.lru_cache(maxsize=64)
def _generation_prompt(tokenizer: Any, enable_thinking: bool) -> tuple[int, ...]:
    without = _render(tokenizer, _PLACEHOLDER_USER, None)
    with_prompt = _render(
        tokenizer, _PLACEHOLDER_USER, None, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    if not with_prompt.startswith(without):
        raise ValueError("the chat template's generation prompt is not an append-only suffix")
    return tuple(_encode(tokenizer, with_prompt[len(without) :]))


def generation_prompt_ids(tokenizer: Any, enable_thinking: bool) -> list[int]:
    """Tokens that open the next assistant turn (e.g. '<|im_start|>assistant\\n')."""
    return list(_generation_prompt(tokenizer, enable_thinking))


@functools.lru_cache(maxsize=64)
def _end_of_assistant_turn(tokenizer: Any) -> str:
    """Text the template puts after an assistant turn's EOS token (usually a newline)."""
    text = _render(tokenizer, _PLACEHOLDER_USER + [_PLACEHOLDER_ASSISTANT], None)
    end = text.rfind(tokenizer.eos_token)
    if end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with {tokenizer.eos_token!r}")
    return text[end + len(tokenizer.eos_token) :]


def observation_token_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Tokens the chat template appends after an assistant turn that ended with the EOS token
    and before the next generation prompt, for the given tool/user messages."""
    before = _render(tokenizer, _PLACEHOLDER_USER, None)
    after = _render(tokenizer, _PLACEHOLDER_USER + messages, None)
    if not after.startswith(before):
        raise ValueError("the chat template re-renders earlier user turns; deltas are undefined")
    # The sampled completion already ends with EOS; what the template puts after it belongs
    # to the observation.
    return _encode(tokenizer, _end_of_assistant_turn(tokenizer) + after[len(before) :])
