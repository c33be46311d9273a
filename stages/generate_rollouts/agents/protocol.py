"""The requests the agents' endpoint serves, as pydantic models: chat completions, Responses and
/inference/v1/generate. A body of the wrong shape is refused with a 400 whose `param` names the field
at fault (`messages.2.role`, `tools.0`, `input.1.call_id`), before anything is rendered or sampled.

Types are strict: a string is not a number ("n": "2" and "max_tokens": "100" are refused). Unknown
fields are accepted, since harnesses send many that change nothing mtrl samples (user, metadata,
store, parallel_tool_calls ...). The sampling fields (temperature, top_p, seed, the penalties) are
accepted and not applied: every call is sampled with the run's settings, since the update needs the
logprobs of the distribution that sampled. A field that would change what the model sees or how a
completion ends and that mtrl does not honour is refused, naming it (`refused_unless`): ignoring it
would record a call the agent did not ask for. Stop strings are honoured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from stages.generate_rollouts.agents.record import RequestError


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def refused_unless(accepted: Callable[[Any], bool], why: str) -> BeforeValidator:
    """A field mtrl does not honour: a value other than `accepted` ones is refused with `why`."""

    def check(value: Any) -> Any:
        if not accepted(value):
            raise ValueError(why)
        return value

    return BeforeValidator(check)


def forms(what: str, **members: Any) -> Any:
    """A field that takes several JSON forms (string=..., list=..., null=None), each checked as its own
    type: a value of another form gets one error, `must be {what}`, not one per form."""
    kinds = {"string": str, "list": list, "null": type(None)}

    def form(value: Any) -> str | None:
        return next((name for name in members if isinstance(value, kinds[name])), None)

    union = Union[tuple(Annotated[kind, Tag(name)] for name, kind in members.items())]  # noqa: UP007  (of a tuple)
    return Annotated[union, Discriminator(form, custom_error_type="form", custom_error_message=f"must be {what}")]


def _function_only(kind: str) -> str:
    if kind != "function":
        raise ValueError(f"only function tools are served, not '{kind}'")
    return kind


def _one_completion(n: int) -> int:
    if n > 1:
        raise ValueError("one completion per call only (n: 1): a rollout samples one")
    return n


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(stops):
        raise ValueError("a stop string must not be empty")
    return stops


ToolType = Annotated[str, AfterValidator(_function_only)]
Tokens = Annotated[int, Field(ge=1)]
# Stop strings, honoured: the call ends when its text holds one (its reply's text is cut before it).
Stop = Annotated[
    forms("a string or a list of strings", string=str, list=list[str], null=None), AfterValidator(_stop_strings)
]
FORCED_TOOL = "only 'auto' is honoured: the policy decides whether to call a tool"
PLAIN_TEXT = "only plain text ({'type': 'text'}) is served: the policy's replies are not constrained"


class Sampled(Body):
    """The fields of one sampled completion, as chat completions and generate's sampling_params take them."""

    n: Annotated[int, AfterValidator(_one_completion)] | None = None
    max_tokens: Tokens | None = None
    stop: Stop = ()
    logit_bias: Annotated[Any, refused_unless(lambda bias: not bias, "not honoured")] = None
    prompt_logprobs: Annotated[Any, refused_unless(lambda v: v is None, "not served")] = None
    best_of: Annotated[Any, refused_unless(lambda v: v in (None, 1), "one completion per call only")] = None
    min_tokens: Annotated[Any, refused_unless(lambda v: v in (None, 0), "not honoured")] = None
    ignore_eos: Annotated[
        Any, refused_unless(lambda v: v in (None, False), "not honoured: a call ends at the policy's EOS tokens")
    ] = None


# ---------------------------------------------------------------- chat completions


class TextPart(Body):
    type: Literal["text", "input_text", "output_text"]
    text: str


Content = forms("a string, null or a list of text parts", string=str, list=list[TextPart], null=None)
Text = forms("a string or a list of text parts", string=str, list=list[TextPart])


class FunctionCall(Body):
    name: str
    arguments: str = "{}"


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(Body):
    type: ToolType
    function: FunctionSpec


class StreamOptions(Body):
    include_usage: bool | None = None


class ChatRequest(Sampled):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Annotated[Any, refused_unless(lambda choice: choice in (None, "auto"), FORCED_TOOL)] = None
    max_completion_tokens: Tokens | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    response_format: Annotated[Any, refused_unless(lambda f: f in (None, {"type": "text"}), PLAIN_TEXT)] = None
    echo: Annotated[Any, refused_unless(lambda v: v in (None, False), "not served")] = None
    functions: Annotated[Any, refused_unless(lambda v: v is None, "not served: use tools")] = None
    function_call: Annotated[Any, refused_unless(lambda v: v is None, "not served: use tools")] = None
    chat_template_kwargs: Annotated[
        Any, refused_unless(lambda v: not v, "not honoured: the chat template's arguments are the run's settings")
    ] = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------- Responses


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text


class InputFunctionCall(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class InputFunctionCallOutput(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Text


class InputReasoning(Body):
    type: Literal["reasoning"]  # the sampled tokens hold the reasoning already: its content is not read


ITEM_TYPES = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionCallOutput,
    "reasoning": InputReasoning,
}


def _item_type(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in ITEM_TYPES.items())],  # noqa: UP007
    Discriminator(
        _item_type,
        custom_error_type="item_type",
        custom_error_message=f"an input item must be an object of type {', '.join(ITEM_TYPES)}",
    ),
]


class ResponsesTool(Body):
    type: ToolType
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class TextSettings(Body):
    format: Annotated[Any, refused_unless(lambda f: f in (None, {"type": "text"}), PLAIN_TEXT)] = None


Input = forms(
    "a string or a non-empty list of input items", string=str, list=Annotated[list[InputItem], Field(min_length=1)]
)


class ResponsesRequest(Body):
    input: Input
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Annotated[Any, refused_unless(lambda choice: choice in (None, "auto"), FORCED_TOOL)] = None
    max_output_tokens: Tokens | None = None
    stream: bool | None = None
    text: TextSettings | None = None
    previous_response_id: Annotated[
        Any, refused_unless(lambda v: v is None, "not served: send the whole history as input")
    ] = None
    conversation: Annotated[Any, refused_unless(lambda v: v is None, "not served: send the whole history as input")] = (
        None
    )
    prompt: Annotated[Any, refused_unless(lambda v: v is None, "not served")] = None
    truncation: Annotated[
        Any, refused_unless(lambda v: v in (None, "disabled"), "not honoured: the context is never cut")
    ] = None


# ---------------------------------------------------------------- token ids (verifiers' train client)


class GenerateRequest(Body):
    token_ids: Annotated[list[int], Field(min_length=1)]
    sampling_params: Sampled = Sampled()


# ---------------------------------------------------------------- refusals and retries


def refusal(error: ValidationError, body: Any) -> RequestError:
    """A 400 that names the fields at fault, as the body spells them: `messages.2.role`."""
    reasons, params = [], []
    for found in error.errors(include_url=False, include_context=False, include_input=False):
        param = _param(found["loc"], found["type"] == "missing", body)
        reason = found["msg"].removeprefix("Value error, ")
        reasons.append(f"{param}: {reason}" if param else reason)
        params.append(param)
    return RequestError("; ".join(dict.fromkeys(reasons)), 400, params[0] or None)


def _param(location: tuple[int | str, ...], missing: bool, body: Any) -> str:
    """A validation error's location as a path into the body: the steps of `location` that exist in
    the body (the others name a form or item type the value was checked as); for a missing field, its
    name last."""
    path, value = [], body
    for index, step in enumerate(location):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        elif not (missing and index == len(location) - 1):
            continue
        path.append(str(step))
    return ".".join(path)


def digest(body: dict[str, Any]) -> str:
    """What makes two requests the same call: the body, streamed or not."""
    asked = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
