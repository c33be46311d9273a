"""Agent programs against mtrl's OpenAI-compatible endpoint (stages/generate_rollouts/agents): the wire
(real HTTP on 127.0.0.1, the openai client), the record (segments, retries, refusals) and agents that
misbehave. The harnesses' whole iterations are tests/test_agent_harnesses.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from datasets import Features

from pipeline.models.base_model import EMBEDDED_POLICY
from pipeline.orchestration.stage_runs import settings_of
from schemas.config import RunConfig
from schemas.features import AGENT_STATE, GENERATE_ROLLOUTS, TOKENS, FinishReason, dataset_from_rows
from schemas.token_stream import prompt_token_ids
from stages.generate_rollouts import agent_records, rollout_starts, sampling_seed
from stages.generate_rollouts.agents.endpoint import Endpoint
from stages.generate_rollouts.agents.record import RolloutRecord
from stages.generate_rollouts.agents.run import agent_rows
from stages.generate_rollouts.agents.server import MAX_BODY_BYTES
from stages.generate_rollouts.engine import CancelledRequestError, open_engine
from stages.policy.batching import rollout_sequences
from stages.policy.loading import load_tokenizer

KEY = "test-key"
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}
CHAT, RESPONSES, GENERATE = "/v1/chat/completions", "/v1/responses", "/inference/v1/generate"


def generate_settings(rollouts=4, **agent):
    config = RunConfig(task={"rollouts": rollouts, "group_size": 2}, agent=agent)
    return settings_of("generate-rollouts", config)


@pytest.fixture(scope="module")
def policy():
    tokenizer = load_tokenizer(EMBEDDED_POLICY)
    settings = generate_settings()
    return open_engine(EMBEDDED_POLICY, tokenizer, settings.engine), tokenizer, settings


@contextmanager
def served(policy, call_limit=4, max_context_tokens=None, rollouts=2):
    """An endpoint over the first `rollouts` rollouts of iteration 0; yields (endpoint, records, starts)."""
    engine, tokenizer, settings = policy
    starts = rollout_starts(generate_settings(max(4, rollouts + rollouts % 2)), 0)[:rollouts]
    records = {start["rollout_id"]: RolloutRecord(start, call_limit) for start in starts}
    endpoint = Endpoint(
        engine,
        tokenizer,
        records,
        sampling=settings.engine.sampling(),
        max_new_tokens=settings.max_new_tokens,
        max_context_tokens=max_context_tokens or settings.engine.max_context_tokens,
        enable_thinking=settings.enable_thinking,
        seed_of=lambda rollout_id, call: sampling_seed(0, 0, rollout_id, call),
        model="policy",
        api_key=KEY,
    )
    with endpoint:
        yield endpoint, records, starts


def chat_body(start, **extra):
    return {"model": "policy", "messages": start["messages"], "tools": start["tools"], **extra}


def post(endpoint, rollout_id, route, body, key=KEY, headers=None):
    url = f"{endpoint.base_url}/rollouts/{rollout_id}{route}"
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=120)


@contextmanager
def kept_alive(**settings):
    """An httpx client, and the connection each of its responses came on (the client's port), in order."""
    ports = []

    def note(response):
        ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])

    with httpx.Client(timeout=120, event_hooks={"response": [note]}, **settings) as client:
        yield client, ports


def test_a_retried_identical_request_is_answered_from_the_record_not_sampled_again(policy):
    with served(policy) as (endpoint, records, starts):
        first = post(endpoint, 0, CHAT, chat_body(starts[0]))
        again = post(endpoint, 0, CHAT, chat_body(starts[0]))
        retried = post(endpoint, 0, CHAT, chat_body(starts[0]), headers={"x-stainless-retry-count": "1"})
        other = post(endpoint, 0, CHAT, chat_body(starts[0], temperature=0.5))
        # the openai client marks its first attempts: asking the same again on purpose is a new call
        asked_again = post(endpoint, 0, CHAT, chat_body(starts[0]), headers={"x-stainless-retry-count": "0"})
    assert {answer.status_code for answer in (first, again, retried, other, asked_again)} == {200}
    assert again.json()["choices"] == retried.json()["choices"] == first.json()["choices"]
    assert again.json()["id"] == retried.json()["id"] == first.json()["id"] == "chatcmpl-0-0"
    assert other.json()["id"] == "chatcmpl-0-1" and asked_again.json()["id"] == "chatcmpl-0-2"
    assert len(records[0].calls) == 3  # the retries added none


def test_a_request_without_the_key_or_for_an_unknown_rollout_changes_nothing_and_keeps_its_connection(policy, capfd):
    """On one kept-alive connection: refusals whose bodies the server never reads, then a served call."""
    with served(policy) as (endpoint, records, starts), kept_alive() as (client, ports):
        big = chat_body(starts[0], padding="x" * 200_000)  # skipped unread: the next request follows it
        refusals = [
            (0, CHAT, {"Authorization": "Bearer not-the-key"}),
            (0, CHAT, {}),  # no key
            (99, CHAT, AUTHORIZED),  # no such rollout
            (0, "/v1/embeddings", AUTHORIZED),  # no such route
        ]
        refused = [
            client.post(f"{endpoint.base_url}/rollouts/{rollout_id}{route}", json=big, headers=headers)
            for rollout_id, route, headers in refusals
        ]
        unknown_session = client.post(
            f"{endpoint.base_url}{CHAT}", json=big, headers={**AUTHORIZED, "X-Session-ID": "99"}
        )
        served_call = client.post(
            f"{endpoint.base_url}/rollouts/0{CHAT}", json=chat_body(starts[0]), headers=AUTHORIZED
        )
    answers = [*refused, unknown_session, served_call]
    assert [answer.status_code for answer in answers] == [401, 401, 404, 404, 404, 200]
    for answer in answers[:-1]:
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert (
        "API key" in refused[0].json()["error"]["message"] and "no rollout 99" in refused[2].json()["error"]["message"]
    )
    assert len(ports) == 6 and len(set(ports)) == 1  # one connection, kept alive throughout
    assert [record.failure for record in records.values()] == [None, None]  # no rollout failed
    assert len(records[0].calls) == 1
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def chat_with(**fields):
    """A rollout's first chat request with these fields."""
    return lambda start: chat_body(start, **fields)


def given(body):
    """This body, whatever the rollout."""
    return lambda start: body


# (name, route, the body for a rollout's start (bytes sent as they are), the field named, what the message says)
WRONG_SHAPES = [
    ("a tool that is not an object", CHAT, chat_with(tools=["calculate"]), "tools.0", "dictionary"),
    ("a tool that is no function", CHAT, chat_with(tools=[{"type": "web_search"}]), "tools.0.type", "function tools"),
    ("n as a string", CHAT, chat_with(n="2"), "n", "valid integer"),
    ("n > 1", CHAT, chat_with(n=2), "n", "one completion per call"),
    ("max_tokens as a string", CHAT, chat_with(max_tokens="100"), "max_tokens", "valid integer"),
    (
        "an unknown role with a number as content",
        CHAT,
        lambda start: chat_body(start, messages=[*start["messages"], {"role": "wizard", "content": 5}]),
        "messages.2.role",
        "'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
    (
        "a Responses function_call without call_id",
        RESPONSES,
        given({"input": [{"role": "user", "content": "2+2?"}, {"type": "function_call", "name": "calculate"}]}),
        "input.1.call_id",
        "Field required",
    ),
    (
        "a stored history",
        RESPONSES,
        given({"input": "2+2?", "previous_response_id": "resp_0_0"}),
        "previous_response_id",
        "whole history",
    ),
    ("a forced tool_choice", CHAT, chat_with(tool_choice="required"), "tool_choice", "only 'auto'"),
    ("a JSON reply format", CHAT, chat_with(response_format={"type": "json_object"}), "response_format", "plain text"),
    ("logit_bias", CHAT, chat_with(logit_bias={"42": 100}), "logit_bias", "not honoured"),
    (
        "template arguments",
        CHAT,
        chat_with(chat_template_kwargs={"enable_thinking": False}),
        "chat_template_kwargs",
        "run's settings",
    ),
    ("token ids outside the vocabulary", GENERATE, given({"token_ids": [10**9]}), "token_ids", "vocabulary"),
    ("a body that is not JSON", CHAT, given(b"{not json"), None, "not JSON"),
    ("a JSON array", CHAT, given(b"[1, 2]"), None, "a JSON object"),
    (
        "a context over the budget",
        CHAT,
        chat_with(messages=[{"role": "user", "content": "7 " * 3000}]),
        None,
        "over the budget",
    ),
]
ROLLOUTS = len(WRONG_SHAPES) + 3  # rollout 0 serves, each wrong shape fails its own, two more for the 413s


@pytest.fixture(scope="module")
def sampled_once(policy):
    """An endpoint over ROLLOUTS rollouts whose rollout 0 made a call: asked again, it is answered from the record."""
    with served(policy, rollouts=ROLLOUTS) as (endpoint, records, starts):
        assert post(endpoint, 0, CHAT, chat_body(starts[0])).status_code == 200
        yield endpoint, records, starts


@pytest.mark.parametrize(
    ("rollout_id", "route", "body", "param", "says"),
    [pytest.param(rollout_id, *case[1:], id=case[0]) for rollout_id, case in enumerate(WRONG_SHAPES, start=1)],
)
def test_a_body_mtrl_cannot_serve_gets_a_json_400_naming_the_field_and_fails_only_its_rollout(
    sampled_once, capfd, rollout_id, route, body, param, says
):
    endpoint, records, starts = sampled_once
    content = body(starts[rollout_id])
    with kept_alive(headers=AUTHORIZED) as (client, ports):
        refused = client.post(
            f"{endpoint.base_url}/rollouts/{rollout_id}{route}",
            content=content if isinstance(content, bytes) else json.dumps(content),
        )
        served_call = client.post(f"{endpoint.base_url}/rollouts/0{CHAT}", json=chat_body(starts[0]))
        later = client.post(f"{endpoint.base_url}/rollouts/{rollout_id}{CHAT}", json=chat_body(starts[rollout_id]))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"
    assert served_call.status_code == 200 and len(set(ports)) == 1  # the connection lives on
    assert records[rollout_id].failure is not None and says in records[rollout_id].failure  # never scored
    assert later.status_code == 409 and not records[rollout_id].calls
    assert records[0].failure is None and len(records[0].calls) == 1
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_a_body_over_the_limit_gets_a_413_and_the_connection_stays_usable(sampled_once):
    endpoint, records, starts = sampled_once
    declared, chunked = ROLLOUTS - 2, ROLLOUTS - 1

    def chunks():  # no Content-Length: counted as it comes
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b" " * 2**20

    with kept_alive(headers=AUTHORIZED) as (client, ports):
        too_long = b" " * (MAX_BODY_BYTES + 1)
        over = [
            client.post(f"{endpoint.base_url}/rollouts/{declared}{CHAT}", content=too_long),
            client.post(f"{endpoint.base_url}/rollouts/{chunked}{CHAT}", content=chunks()),
        ]
        served_call = client.post(f"{endpoint.base_url}/rollouts/0{CHAT}", json=chat_body(starts[0]))
    assert [answer.status_code for answer in over] == [413, 413]
    assert (
        "over the limit" in over[0].json()["error"]["message"]
        and "over the limit" in over[1].json()["error"]["message"]
    )
    assert served_call.status_code == 200 and len(ports) == 3 and len(set(ports)) == 1
    assert records[declared].failure is not None and records[chunked].failure is not None


class PausedEngine:
    """The policy's engine (its serve()), paused once after its first decode step (serve's first take while
    it decodes) until the test lets it go on; every outcome it gives back is kept."""

    def __init__(self, engine):
        self.engine = engine
        self.decoding, self.go_on = threading.Event(), threading.Event()
        self.outcomes = []

    def serve(self, take, give, sampling):
        def paused_take(idle):
            if not idle and not self.decoding.is_set():
                self.decoding.set()
                assert self.go_on.wait(120)
            return take(idle)

        def kept_give(tag, outcome):
            self.outcomes.append(outcome)
            give(tag, outcome)

        self.engine.serve(paused_take, kept_give, sampling)


def test_a_client_that_goes_away_mid_call_stops_its_sampling_and_its_retry_gets_the_same_tokens(policy, capfd):
    engine, tokenizer, settings = policy
    paused = PausedEngine(engine)
    with served((paused, tokenizer, settings)) as (endpoint, records, starts):
        body = json.dumps(chat_body(starts[0])).encode()
        head = f"POST /rollouts/0{CHAT} HTTP/1.1\r\nHost: mtrl\r\nAuthorization: Bearer {KEY}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", int(endpoint.base_url.rsplit(":", 1)[1]))) as client:
            client.sendall(head.encode() + body)
            assert paused.decoding.wait(120)  # its call is being sampled ...
        for _ in range(1200):  # ... its client has gone away: the call leaves the record
            if not records[0].calls:
                break
            time.sleep(0.1)
        assert not records[0].calls
        paused.go_on.set()  # the engine sees the call dropped at its next step
        retried = post(endpoint, 0, CHAT, chat_body(starts[0]))
    with served(policy) as (uninterrupted, alone, _):  # the same call, never interrupted
        post(uninterrupted, 0, CHAT, chat_body(starts[0]))
    dropped = paused.outcomes[0]
    assert isinstance(dropped, CancelledRequestError) and len(dropped.token_ids) == 1  # one decode step, no more
    assert retried.status_code == 200 and retried.json()["id"] == "chatcmpl-0-0"  # the same call again
    (call,) = records[0].calls
    assert call.completion[:1] == dropped.token_ids and len(call.completion) > 1
    assert call.completion == alone[0].calls[0].completion and call.seed == alone[0].calls[0].seed
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_stop_strings_end_the_call_and_its_reply_stops_before_them(policy):
    with served(policy) as (endpoint, records, starts):
        plain = post(endpoint, 0, CHAT, chat_body(starts[0])).json()["choices"][0]
        stopped = post(endpoint, 1, CHAT, chat_body(starts[1], stop=['"name"'])).json()["choices"][0]
    assert plain["message"]["tool_calls"]  # uninterrupted, it calls the calculator
    assert records[1].calls[0].finish_reason == FinishReason.STOP_STRING and stopped["finish_reason"] == "stop"
    sampled = policy[1].decode(records[1].calls[0].completion)
    assert '"name"' in sampled and '"name"' not in stopped["message"]["content"]  # the record keeps every token
    assert stopped["message"]["content"].endswith("{")  # cut right before the stop string


def test_the_openai_client_streams_chat_completions_reads_responses_and_models(policy):
    with served(policy) as (endpoint, records, starts):
        client = openai.OpenAI(base_url=f"{endpoint.base_url}/rollouts/0/v1", api_key=KEY, max_retries=0)
        models = client.models.list().data
        chunks = list(
            client.chat.completions.create(
                model="policy",
                messages=starts[0]["messages"],
                tools=starts[0]["tools"],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        responses = openai.OpenAI(base_url=f"{endpoint.base_url}/rollouts/1/v1", api_key=KEY, max_retries=0)
        system, question = (m["content"] for m in starts[1]["messages"])
        tools = [{"type": "function", **schema["function"]} for schema in starts[1]["tools"]]
        answer = responses.responses.create(model="policy", instructions=system, input=question, tools=tools)
    assert models[0].id == "policy" and models[0].model_extra["max_model_len"] == policy[2].engine.max_context_tokens
    call = records[0].calls[0]
    streamed_calls = [tc for chunk in chunks if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    assert [tc.id for tc in streamed_calls] == [tc["id"] for tc in call.tool_calls]
    assert chunks[-1].usage.completion_tokens == len(call.completion)
    response_call = records[1].calls[0]
    function_calls = [item for item in answer.output if item.type == "function_call"]
    assert [item.call_id for item in function_calls] == [tc["id"] for tc in response_call.tool_calls]
    assert answer.usage.output_tokens == len(response_call.completion)


def test_streamed_responses_end_with_the_response_and_a_session_header_names_the_rollout(policy):
    with served(policy) as (endpoint, records, starts):
        client = openai.OpenAI(base_url=f"{endpoint.base_url}/rollouts/0/v1", api_key=KEY, max_retries=0)
        system, question = (m["content"] for m in starts[0]["messages"])
        tools = [{"type": "function", **schema["function"]} for schema in starts[0]["tools"]]
        body = {"model": "policy", "instructions": system, "input": question, "tools": tools}
        events = list(client.responses.create(**body, stream=True))
        # the same request retried (as the openai client marks a retry): answered from the record
        answered = client.responses.create(**body, extra_headers={"x-stainless-retry-count": "1"})
        at_root = openai.OpenAI(base_url=f"{endpoint.base_url}/v1", api_key=KEY, max_retries=0)
        by_session = at_root.chat.completions.create(
            model="policy", messages=starts[1]["messages"], extra_headers={"X-Session-ID": "1"}
        )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output == answered.output and len(records[0].calls) == 1
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == [item.type for item in answered.output]
    assert by_session.id == "chatcmpl-1-0" and len(records[1].calls) == 1  # rollout 1's first call


def test_token_ids_in_and_out_continue_one_stream(policy):
    """verifiers' train client: token ids in, token ids and one logprob per token out."""
    engine, tokenizer, settings = policy
    with served(policy) as (endpoint, records, starts):
        context = prompt_token_ids(tokenizer, starts[0]["messages"], starts[0]["tools"], settings.enable_thinking)
        sampling = {"temperature": 1.0, "max_tokens": 40, "logprobs": 1, "skip_special_tokens": False}
        first = post(endpoint, 0, "/inference/v1/generate", {"token_ids": context, "sampling_params": sampling}).json()
        tokens = first["choices"][0]["token_ids"]
        rendered = context + tokens + tokenizer.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
        post(endpoint, 0, "/inference/v1/generate", {"token_ids": rendered, "sampling_params": sampling})
        bad = post(endpoint, 1, "/inference/v1/generate", {"token_ids": [10**9], "sampling_params": sampling})
    logprobs = first["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in logprobs] == [f"token_id:{token}" for token in tokens]
    assert [entry["logprob"] for entry in logprobs] == records[0].calls[0].logprobs
    assert records[0].calls[0].context == context and not records[0].calls[1].new_segment
    assert records[0].calls[1].stream == rendered
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def agents(policy, function, **agent):
    engine, tokenizer, _ = policy
    return agent_records(engine, tokenizer, generate_settings(function=function, **agent), 0)


@pytest.mark.parametrize(
    ("function", "timeout_s", "says"),
    [
        ("tests.agent_programs:raises", 60, "the agent raised RuntimeError: the agent's own bug"),
        # the deadline leaves the agents that return time for their call on a loaded machine (4 s did not once)
        pytest.param("tests.agent_programs:hangs", 10, "did not return within 10 s", marks=pytest.mark.slow),
        pytest.param(
            "tests.agent_programs:hangs_in_sync_code", 10, "did not return within 10 s", marks=pytest.mark.slow
        ),
    ],
)
def test_an_agent_that_raises_or_hangs_fails_its_rollout_and_the_others_go_on(policy, function, timeout_s, says):
    records = agents(policy, function, timeout_s=timeout_s)
    for rollout_id, record in records.items():
        if rollout_id % 2:
            assert record.failure is not None and says in record.failure
        else:
            assert record.failure is None and record.calls
    rows = agent_rows(records, 0, policy[1])
    ends = [row for row in rows if row["rollout_id"] % 2]
    assert all('"failed"' in row["env_state"] for row in ends)  # turn 0 is their last: stop_reason failed


def test_an_agents_returned_reward_is_recorded(policy):
    records = agents(policy, "tests.agent_programs:returns_rewards")
    assert {rollout_id: record.reward for rollout_id, record in records.items()} == {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3}


def test_agents_whose_clients_go_away_or_send_a_wrong_key_leave_no_traceback(policy, capfd):
    records = agents(policy, "tests.agent_programs:own_connections")
    assert [record.failure for record in records.values()] == [None] * len(records)
    assert all(record.calls for record in records.values())
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def segments_of(records, tokenizer):
    """The rows of every turn of the records, and their rollouts' training sequences."""
    rows = [row for turn in range(4) for row in agent_rows(records, turn, tokenizer)]
    for row in rows:  # as execute-tools stores them: the tokens the agent added after the call
        row["observation_token_ids"] = json.loads(row["env_state"])[AGENT_STATE]["observation_token_ids"]
        row.update(iteration=0, policy_version="p")
    dataset = dataset_from_rows(rows, Features({**GENERATE_ROLLOUTS, "observation_token_ids": TOKENS}))
    return rows, rollout_sequences(dataset)


@pytest.mark.parametrize("function", ["tests.agent_programs:edits_history", "tests.agent_programs:asks_again"])
def test_a_history_that_does_not_extend_the_stream_starts_a_segment_that_trains_on_its_sampled_tokens(policy, function):
    engine, tokenizer, settings = policy
    records = agents(policy, function)
    for record in records.values():
        assert record.failure is None and len(record.calls) == 2
        first, second = record.calls
        if function.endswith("asks_again"):  # the case needs a first turn with a <think> block
            assert "<think>" in tokenizer.decode(first.completion)
        assert second.new_segment and second.context == second.stream  # stored whole
        before = first.stream + first.completion
        assert second.stream[: len(before)] != before  # the history no longer extends the stream
    rows, sequences = segments_of(records, tokenizer)
    assert [row["stream_offset"] for row in rows if row["turn"] == 1] == [0] * len(records)
    assert len(sequences) == 2 * len(records)  # one sequence per segment
    calls = [call for rollout_id in sorted(records) for call in records[rollout_id].calls]
    for sequence, call in zip(sequences, calls):
        trained = [sequence.token_ids[position] for position in sequence.target_positions]
        assert trained == call.completion  # the sampled tokens, nothing re-tokenized
        assert sequence.token_ids[: sequence.target_positions[0]] == call.stream  # what the model saw
        assert sequence.generation_logprobs == call.logprobs


@pytest.mark.parametrize(
    "function", ["examples.agents.openai_loop:agent", "examples.agents.agents_sdk:responses_streamed"]
)
def test_a_growing_history_is_one_stream_of_deltas(policy, function):
    engine, tokenizer, settings = policy
    records = agents(policy, function)
    multi = [record for record in records.values() if len(record.calls) > 1]
    assert multi, "no rollout made a second call"
    for record in multi:
        first, second = record.calls[:2]
        assert not second.new_segment
        assert second.stream[: len(first.stream) + len(first.completion)] == first.stream + first.completion
        assert second.context == second.stream[len(second.stream) - len(second.context) :]
    _, sequences = segments_of(records, tokenizer)
    assert len(sequences) == len(records)
