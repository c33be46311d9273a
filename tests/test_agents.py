"""Agent programs against mtrl's OpenAI-compatible endpoint (stages/generate_rollouts/agents): the wire
(real HTTP on 127.0.0.1, the openai client), the record (segments, retries, refusals) and agents that
misbehave. The harnesses' whole iterations are tests/test_agent_harnesses.py."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from datasets import Features

from pipeline.models import EMBEDDED_POLICY
from pipeline.stage_runs import settings_of
from schemas.config import RunConfig
from schemas.features import AGENT_STATE, GENERATE_ROLLOUTS, TOKENS, dataset_from_rows
from schemas.token_stream import prompt_token_ids
from stages.generate_rollouts import agent_records, rollout_starts, sampling_seed
from stages.generate_rollouts.agents.endpoint import Endpoint
from stages.generate_rollouts.agents.record import RolloutRecord
from stages.generate_rollouts.agents.run import agent_rows
from stages.generate_rollouts.engine import open_engine
from stages.policy.batching import rollout_sequences
from stages.policy.loading import load_tokenizer

KEY = "test-key"


def generate_settings(**agent):
    config = RunConfig(task={"rollouts": 4, "group_size": 2}, agent=agent)
    return settings_of("generate-rollouts", config)


@pytest.fixture(scope="module")
def policy():
    tokenizer = load_tokenizer(EMBEDDED_POLICY)
    settings = generate_settings()
    return open_engine(EMBEDDED_POLICY, tokenizer, settings.engine), tokenizer, settings


@contextmanager
def served(policy, call_limit=4, max_context_tokens=None):
    """An endpoint over the first two rollouts of iteration 0; yields (endpoint, records, starts)."""
    engine, tokenizer, settings = policy
    starts = rollout_starts(settings, 0)[:2]
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


def post(endpoint, rollout_id, route, body, key=KEY):
    url = f"{endpoint.base_url}/rollouts/{rollout_id}{route}"
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_a_retried_identical_request_is_answered_from_the_record_not_sampled_again(policy):
    with served(policy) as (endpoint, records, starts):
        first = post(endpoint, 0, "/v1/chat/completions", chat_body(starts[0]))
        again = post(endpoint, 0, "/v1/chat/completions", chat_body(starts[0]))
        other = post(endpoint, 0, "/v1/chat/completions", chat_body(starts[0], temperature=0.5))
    assert first.status_code == again.status_code == other.status_code == 200
    assert again.json()["choices"] == first.json()["choices"] and again.json()["id"] == first.json()["id"]
    assert len(records[0].calls) == 2  # the retry added none; a different body is a new call
    assert other.json()["id"] != first.json()["id"]


@pytest.mark.parametrize(
    ("name", "rollout_id", "body", "key", "status", "says"),
    [
        ("unknown rollout", 99, {}, KEY, 404, "no rollout 99"),
        ("wrong key", 0, {}, "not-the-key", 401, "API key"),
        ("n > 1", 0, {"n": 2}, KEY, 400, "n > 1"),
        ("over the budget", 0, {"messages": [{"role": "user", "content": "7 " * 3000}]}, KEY, 400, "over the budget"),
        ("template fails", 0, {"messages": [{"role": "user", "content": 5}]}, KEY, 400, "cannot render"),
        ("not a tool", 0, {"tools": [{"type": "web_search"}]}, KEY, 400, "only function tools"),
    ],
)
def test_a_request_mtrl_cannot_serve_gets_a_4xx_that_says_why_and_fails_only_its_rollout(
    policy, name, rollout_id, body, key, status, says
):
    with served(policy) as (endpoint, records, starts):
        refused = post(endpoint, rollout_id, "/v1/chat/completions", {**chat_body(starts[0]), **body}, key=key)
        others = post(endpoint, 1, "/v1/chat/completions", chat_body(starts[1]))
        later = post(endpoint, 0, "/v1/chat/completions", chat_body(starts[0]))
    assert refused.status_code == status, refused.text
    assert says in refused.json()["error"]["message"]
    assert others.status_code == 200 and records[1].failure is None
    if rollout_id == 0:  # its rollout is failed (never scored), and says why
        assert records[0].failure is not None and says in records[0].failure
        assert later.status_code == 409
    else:
        assert records[0].failure is None and later.status_code == 200


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
        answered = client.responses.create(**body)  # the same request: answered from the record
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
        ("tests.agent_programs:hangs", 4, "did not return within 4 s"),
        ("tests.agent_programs:hangs_in_sync_code", 4, "did not return within 4 s"),
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
