"""An agent call's context, rendered from what its request adds (record.next_call): the same tokens,
segments and observations as the whole rendering (record.render_context) for every kind of history
an agent sends, and only what was added rendered while the history grows by replies and tool
results. No engine: each call's completion is set here (the tokens a model could have sampled, the
text decoded from them), the rest is the endpoint's own code (reply_of, the wire formats)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models.base_model import EMBEDDED_POLICY
from stages.generate_rollouts.agents import openai_api
from stages.generate_rollouts.agents.record import RolloutRecord, next_call, render_context, reply_of
from stages.policy.loading import load_tokenizer

ROLLOUT = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the hidden number.",
            "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
        },
    }
]
SYSTEM, QUESTION = "You are a helpful assistant.", "I am thinking of a number between 1 and 100. Find it."
OBSERVATION = "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"  # a token-id client's own rendering


def _call_block(number: int) -> str:
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {number}}}}}\n</tool_call>'


# What the model writes at a step, by kind (the step number varies the numbers).
TEXTS = {
    "call": lambda n: f"<think>\nBetween 1 and 100, I will guess {n}.\n</think>\n\n{_call_block(n)}",
    "parallel calls": lambda n: f"<think>\nTwo guesses.\n</think>\n\n{_call_block(n)}\n{_call_block(n + 1)}",
    "text and a call": lambda n: f"<think>\nHm.\n</think>\n\nI guess {n}.\n{_call_block(n)}",
    "answer": lambda n: f"<think>\nIt is {n}.\n</think>\n\nThe number is {n}.",
    "answer without thinking": lambda n: f"The number is {n}.",
    "an answer sent before": lambda n: "<think>\nI know it.\n</think>\n\nThe number is 7.",
    "that answer, other reasoning": lambda n: "<think>\nI am sure.\n</think>\n\nThe number is 7.",
    # an assistant turn's opening inside the reply: render_context finds the turn there, not before it
    "an opening inside": lambda n: f"<think>\nIt is {n}.\n</think>\n\nThe number is {n}.<|im_start|>assistant\nOr not.",
    # two </think>: Qwen3's format renders the turn without its middle (the template rewrites it)
    "rambling": lambda n: f"<think>\nBetween 1.\n</think>\n\nBetween {n}.\n</think>\n\n{_call_block(n)}",
}
KINDS = [*TEXTS, "cut at max_tokens", "tokens split differently"]
BEHAVIOURS = ["tool results", "tool results, then a user turn", "user turn", "edit", "summary", "token ids"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(EMBEDDED_POLICY))


def completion(tokenizer, kind: str, step: int) -> list[int]:
    """Tokens a model could have sampled: finished with the EOS token, cut by max_tokens, or spelled
    with other tokens than the tokenizer's own encoding of their text."""
    number = 10 + 7 * step
    if kind == "cut at max_tokens":  # inside the <think> block
        return tokenizer.encode(TEXTS["call"](number).split(".")[0], add_special_tokens=False)
    if kind == "tokens split differently":  # one character per token: decodes to the same text
        text = TEXTS["call"](number)
        return [token for character in text for token in tokenizer.encode(character, add_special_tokens=False)] + [
            tokenizer.eos_token_id
        ]
    return tokenizer.encode(TEXTS[kind](number), add_special_tokens=False) + [tokenizer.eos_token_id]


@contextmanager
def template_sizes(tokenizer):
    """The number of messages of each rendering of the chat template inside the block."""
    sizes: list[int] = []
    render = tokenizer.apply_chat_template

    def counted(messages, *args, **kwargs):
        sizes.append(len(messages))
        return render(messages, *args, **kwargs)

    tokenizer.apply_chat_template = counted
    try:
        yield sizes
    finally:
        del tokenizer.apply_chat_template  # the class's method again


class Agent:
    """An agent's history, in the chat or the Responses shape, and the request it sends next."""

    def __init__(self, shape: str):
        self.shape = shape
        if shape == "chat":
            self.items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        else:
            self.items = [{"type": "message", "role": "user", "content": QUESTION}]

    def request(self) -> dict:
        """The request as the endpoint hands it to next_call (the wire format's own conversion)."""
        if self.shape == "chat":
            messages, tools = openai_api.chat_request({"messages": self.items, "tools": TOOLS})
        else:
            body = {
                "instructions": SYSTEM,
                "input": self.items,
                "tools": [{"type": "function", **TOOLS[0]["function"]}],
            }
            messages, tools = openai_api.responses_request(body)
        return {"messages": messages, "tools": tools}

    def replied(self, call, tokenizer) -> list[dict]:
        """The reply as the endpoint returned it, added to the history; returns its tool calls."""
        if self.shape == "chat":
            message = openai_api.chat_completion(call, "policy", "id", tokenizer, False)["choices"][0]["message"]
            self.items.append({key: value for key, value in message.items() if value is not None})
        else:
            self.items += openai_api.response(call, "policy", "id", {})["output"]
        return call.tool_calls

    def add(self, role: str, content: str, call_id: str = "call_0") -> None:
        if self.shape == "chat":
            self.items.append(
                {"role": role, "content": content, **({"tool_call_id": call_id} if role == "tool" else {})}
            )
        elif role == "tool":
            self.items.append({"type": "function_call_output", "call_id": call_id, "output": content})
        else:
            self.items.append({"type": "message", "role": role, "content": content})


def tool_results(agent: Agent, calls: list[dict]) -> None:
    """An answer per tool call; an error for a reply without one (as execute-tools answers a malformed block)."""
    for call in calls:
        number = json.loads(call["function"]["arguments"])["number"]
        agent.add("tool", f"higher: between {number + 1} and 100", call["id"])
    if not calls:
        agent.add("tool", "Error: no tool call")


def play(tokenizer, steps: list[tuple[str, str]], shape: str = "chat", enable_thinking: bool = True) -> list[dict]:
    """Run the steps (what the model writes, what the agent does next) through next_call twice: on a
    record that renders what each request adds, and on one that renders every request whole. Both
    must give each call the same stream, context and segment, and each call before it the same
    observation and added messages; the stream must be render_context's. Returns, per call, the
    largest number of messages the template rendered for it and the number of its messages."""
    agent, records = (
        Agent(shape),
        [RolloutRecord({"rollout_id": ROLLOUT}, 100), RolloutRecord({"rollout_id": ROLLOUT}, 100)],
    )
    incremental, whole = records
    rendered: list[dict] = []
    for step, (kind, behaviour) in enumerate([*steps, ("call", "tool results")]):
        previous = incremental.calls[-1] if incremental.calls else None
        if previous is not None and behaviour == "token ids":  # a client that renders itself (verifiers)
            observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
            request = {"token_ids": previous.stream + previous.completion + observation}
        else:
            request = agent.request()
        for call in whole.calls:
            call.rendering = None  # the whole rendering at every call
        with template_sizes(tokenizer) as sizes:
            made = next_call(incremental, tokenizer, request, enable_thinking, seed=step)
        reference = next_call(whole, tokenizer, request, enable_thinking, seed=step)
        assert (made.stream, made.context, made.new_segment) == (
            reference.stream,
            reference.context,
            reference.new_segment,
        )
        if previous is not None:
            before = whole.calls[-1]
            assert (previous.observation, previous.added_messages) == (before.observation, before.added_messages)
        if "messages" in request:
            whole_tokens = render_context(
                tokenizer, request["messages"], request["tools"], incremental.calls, enable_thinking
            )
            assert made.stream == whole_tokens
        rendered.append({"template_sizes": sizes, "messages": len(request.get("messages", [])), "call": made})
        tokens = completion(tokenizer, kind, step)
        for record, call in zip(records, (made, reference)):
            call.completion = list(tokens)
            reply_of(call, tokenizer, ROLLOUT)
            call.done.set()
            record.calls.append(call)
        calls = agent.replied(made, tokenizer)
        if behaviour in ("tool results", "tool results, then a user turn", "token ids"):
            tool_results(agent, calls)
        if behaviour in ("tool results, then a user turn", "user turn"):
            agent.add("user", "Are you sure?")
        if behaviour == "edit":
            agent.items[-2 if shape == "chat" else 0]["content"] += " (edited)"
            tool_results(agent, calls)
        if behaviour == "summary":
            agent.items = agent.items[: 2 if shape == "chat" else 1]
            agent.add("assistant", f"So far I guessed up to {10 + 7 * step}.")
            agent.add("user", "Go on.")
    return rendered


def rendered_whole(step: dict) -> bool:
    return max(step["template_sizes"], default=0) == step["messages"]


def test_a_tool_loop_renders_only_what_each_call_adds_and_stays_one_stream(tokenizer):
    kinds = ["call", "parallel calls", "cut at max_tokens", "tokens split differently", "answer", "call"] * 2
    steps = play(tokenizer, [(kind, "tool results") for kind in kinds])
    assert len(steps) == 13
    for step in steps[1:]:
        assert not step["call"].new_segment
        assert max(step["template_sizes"]) <= 4  # the stand-in user turn, the reply, its tool results
    assert steps[-1]["messages"] == 28  # 2 + 12 replies + 14 tool results


def test_a_reply_sampled_again_token_for_token_is_rendered_from_what_was_added(tokenizer):
    """The same reply twice, the same tokens: the earlier message stands for the newer call, with the same tokens."""
    steps = play(tokenizer, [("an answer sent before", "tool results")] * 3)
    assert not any(rendered_whole(step) or step["call"].new_segment for step in steps[1:])


def test_a_responses_tool_loop_renders_only_what_each_call_adds(tokenizer):
    steps = play(tokenizer, [("call", "tool results"), ("parallel calls", "tool results")] * 3, shape="responses")
    assert not any(rendered_whole(step) or step["call"].new_segment for step in steps[1:])


@pytest.mark.parametrize(
    ("name", "steps", "shape", "enable_thinking", "new_segment"),
    [
        # Qwen3's format drops the <think> block of the reply before the new query (tests/agent_programs.py asks_again)
        ("a user turn after a reply with reasoning", [("call", "tool results, then a user turn")], "chat", True, True),
        # the same for an earlier reply's <think> block, the last reply having none
        (
            "a user turn after an earlier reply with reasoning",
            [("call", "tool results"), ("cut at max_tokens", "tool results, then a user turn")],
            "chat",
            True,
            True,
        ),
        ("an edited history", [("call", "edit")], "chat", True, True),
        ("a summary instead of the history", [("call", "summary")], "chat", True, True),
        # an earlier reply's text with other tokens: the earlier message now stands for the newer call's tokens
        (
            "a reply text sent before",
            [("an answer sent before", "tool results"), ("that answer, other reasoning", "tool results")],
            "chat",
            True,
            True,
        ),
        # rendered plain: the reply as the agent sent it back (its reasoning_content) re-tokenizes to the sampled tokens
        ("a turn the template rewrites", [("rambling", "tool results")], "chat", True, False),
        ("a turn opening inside the reply", [("an opening inside", "tool results")], "chat", True, True),
        # the reply's turn opens without the empty <think> block the generation prompt held
        ("thinking off", [("answer without thinking", "tool results")], "chat", False, True),
        # the Responses form splits a reply of text and tool calls into two assistant messages
        ("text and a call as Responses items", [("text and a call", "tool results")], "responses", True, True),
    ],
)
def test_what_cannot_be_shown_to_extend_the_history_is_rendered_whole(
    tokenizer, name, steps, shape, enable_thinking, new_segment
):
    played = play(tokenizer, steps, shape, enable_thinking)
    last = played[len(steps)]
    assert rendered_whole(last), name
    assert last["call"].new_segment == new_segment, name


def test_token_id_requests_are_taken_as_sent(tokenizer):
    steps = play(tokenizer, [("call", "tool results"), ("call", "token ids"), ("call", "tool results")])
    before, sent = steps[0]["call"], steps[1]["call"]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    assert sent.stream == before.stream + before.completion + observation and not sent.new_segment
    assert rendered_whole(steps[2])  # the call after one that rendered itself renders its history whole
    assert not rendered_whole(steps[3])


def test_a_call_sampled_alongside_makes_the_next_one_render_whole(tokenizer):
    """Two calls of one rollout at once (an agent's parallel branches), both replying the same text: the
    whole rendering then takes an earlier message with that text for the later call's reply, which
    the history the next call extends did not."""
    record, agent = RolloutRecord({"rollout_id": ROLLOUT}, 100), Agent("chat")

    def sampled(call, text: str) -> None:
        call.completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        reply_of(call, tokenizer, ROLLOUT)
        call.done.set()
        record.calls.append(call)

    first = next_call(record, tokenizer, agent.request(), True, seed=0)
    sampled(first, "<think>\nA.\n</think>\n\nThe number is 7.")
    tool_results(agent, agent.replied(first, tokenizer))
    branches = agent.request()
    one, two = (next_call(record, tokenizer, branches, True, seed=seed) for seed in (1, 2))
    sampled(one, "<think>\nB.\n</think>\n\nThe number is 7.")
    sampled(two, TEXTS["call"](5))
    tool_results(agent, agent.replied(two, tokenizer))
    request = agent.request()
    with template_sizes(tokenizer) as sizes:
        after = next_call(record, tokenizer, request, True, seed=3)
    assert max(sizes) == len(request["messages"])
    assert after.stream == render_context(tokenizer, request["messages"], request["tools"], record.calls, True)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    steps=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(BEHAVIOURS)), min_size=1, max_size=7),
    shape=st.sampled_from(["chat", "responses"]),
    enable_thinking=st.booleans(),
)
def test_every_history_gets_the_whole_renderings_tokens(tokenizer, steps, shape, enable_thinking):
    play(tokenizer, steps, shape, enable_thinking)  # play asserts it at every call
