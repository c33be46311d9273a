"""The generation engine: exact logprobs, KV reuse across turns, per-rollout seeds."""

from __future__ import annotations

import logging
import random
import warnings

import pytest
import torch

from pipeline.orchestration.episodes import run_episodes
from schemas.config import RunConfig
from stages.generate_rollouts import hf_serve, sampling_seed
from stages.generate_rollouts.engine import Request, Sampling
from stages.generate_rollouts.hf import HFEngine
from stages.generate_rollouts.sampling import filter_logits
from stages.hermes import split_thinking
from stages.policy.loading import eos_token_ids


class ColdEngine(HFEngine):
    """The reference path: no KV reuse, every turn re-encodes the whole context."""

    def sample(self, requests, sampling, forced=None, report_progress=None):
        self.reset()
        return super().sample(requests, sampling, forced, report_progress)


@pytest.fixture(scope="module")
def config():
    return RunConfig(seed=3, task={"rollouts": 16, "group_size": 4, "max_turns": 3}, generation={"max_new_tokens": 64})


def streams_and_logprobs(turns):
    """rollout -> (full token stream, [(position, stored logprob)])."""
    out = {}
    for row in sorted(turns, key=lambda r: (r["rollout_id"], r["turn"])):
        stream, scored = out.setdefault(row["rollout_id"], ([], []))
        stream += row["context_token_ids"]
        scored += [(len(stream) + i, lp) for i, lp in enumerate(row["completion_logprobs"])]
        stream += row["completion_token_ids"] + row["observation_token_ids"]
    return out


def test_logprobs_equal_a_fresh_forward_pass_over_the_stored_stream(tiny, config):
    model, tokenizer = tiny
    turns = run_episodes(
        HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode), tokenizer, config
    )
    assert max(turns["turn"]) >= 1  # several turns, so KV reuse was exercised
    worst = 0.0
    with torch.no_grad():
        for stream, scored in streams_and_logprobs(turns).values():
            logits = model(torch.tensor([stream])).logits[0].float()
            fresh = torch.log_softmax(logits / config.generation.temperature, -1)
            for position, stored in scored:
                worst = max(worst, abs(fresh[position - 1, stream[position]].item() - stored))
    print(f"max |stored - fresh| logprob difference: {worst:.3g}")
    assert worst < 1e-4


def test_kv_reuse_gives_the_same_tokens_as_re_encoding_every_turn(tiny, config):
    model, tokenizer = tiny
    eos = eos_token_ids(tokenizer, model)
    reused = run_episodes(HFEngine(model, tokenizer.pad_token_id, eos), tokenizer, config)
    cold = run_episodes(ColdEngine(model, tokenizer.pad_token_id, eos), tokenizer, config)
    assert reused["completion_token_ids"] == cold["completion_token_ids"]
    assert reused["observation_token_ids"] == cold["observation_token_ids"]
    difference = max(
        abs(a - b) for x, y in zip(reused["completion_logprobs"], cold["completion_logprobs"]) for a, b in zip(x, y)
    )
    assert difference < 1e-4


def test_a_rollouts_tokens_do_not_depend_on_the_rest_of_the_batch(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    prompts = [
        tokenizer.encode(f"<|im_start|>user\nEvaluate {a}+{a}.<|im_end|>\n<|im_start|>assistant\n") for a in range(5)
    ]
    batch = engine.sample([Request(i, p, sampling_seed(0, 0, i, 0), 24) for i, p in enumerate(prompts)], Sampling(1.0))
    alone = ColdEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model)).sample(
        [Request(3, prompts[3], sampling_seed(0, 0, 3, 0), 24)], Sampling(1.0)
    )
    assert batch[3].token_ids == alone[0].token_ids


class CountingEngine(HFEngine):
    """Records the rows of every forward pass."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rows_per_pass: list[int] = []

    def _forward(self, input_ids, new_mask):
        self.rows_per_pass.append(input_ids.shape[0])
        return super()._forward(input_ids, new_mask)


def test_a_groups_prompt_is_prefilled_once_and_finished_rows_leave_the_batch(tiny):
    """Two groups of three rollouts of one prompt: the prefill computes two rows; every decoding
    pass only the rows still going on. Each completion equals the request decoded alone, and so
    does a second turn that continues the cache the finished rows were put back into (logprobs
    within the batched-vs-alone rounding the engine had before: up to 3e-5 on this model)."""
    model, tokenizer = tiny
    eos = eos_token_ids(tokenizer, model)
    prompts = [
        tokenizer.encode(f"<|im_start|>user\nEvaluate {a}*7.<|im_end|>\n<|im_start|>assistant\n") for a in (4, 9)
    ]
    requests = [Request(i, prompts[i // 3], sampling_seed(0, 0, i, 0), 4 + 3 * i) for i in range(6)]
    engine = CountingEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode)
    completions = engine.sample(requests, Sampling(1.0))
    lengths = [len(c.token_ids) for c in completions]
    assert len(set(lengths)) >= 3  # rows did finish at different steps
    assert engine.rows_per_pass[0] == 2
    assert engine.rows_per_pass[1:] == [sum(n > step for n in lengths) for step in range(1, max(lengths))]

    observation = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    second = [
        Request(r.key, r.token_ids + c.token_ids + observation, sampling_seed(0, 0, r.key, 1), 6)
        for r, c in zip(requests, completions)
    ]
    assert engine.can_continue(second)
    continued = engine.sample(second, Sampling(1.0))
    for turn in ((requests, completions), (second, continued)):
        for request, batched in zip(*turn):
            (alone,) = ColdEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode).sample([request], Sampling(1.0))
            assert batched.token_ids == alone.token_ids
            assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) < 1e-4  # as before: 3e-5


def test_top_k_and_top_p_filtering_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)[0, :2]).all()
    # softmax(4,3,2,1) = .644, .237, .087, .032: top-p 0.8 keeps the two that reach 0.8
    kept = ~torch.isinf(filter_logits(logits, top_k=0, top_p=0.8))
    assert kept.tolist() == [[False, False, True, True]]
    assert not torch.isinf(filter_logits(logits, top_k=0, top_p=1.0)).any()


def test_split_thinking():
    assert split_thinking("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert split_thinking("just an answer") == ("", "just an answer")


def test_a_cold_engine_replays_earlier_turns_and_continues_bit_identically(tiny, config):
    """A resumed run has lost the engine's cache: replaying the stored turns rebuilds it with
    the same forward passes, so the next turn equals the uninterrupted run's bit for bit."""
    from schemas.token_stream import rollouts
    from stages.generate_rollouts import GenerateSettings, generate_rollouts, next_turn

    model, tokenizer = tiny
    warm_engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    uninterrupted = run_episodes(warm_engine, tokenizer, config)
    assert max(uninterrupted["turn"]) >= 1
    history = uninterrupted.filter(lambda row: row["turn"] == 0, keep_in_memory=True)
    cold_engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    settings = GenerateSettings.resolve(config)
    streams = {rollout.rollout_id: rollout.token_ids for rollout in rollouts(history)}
    resumed, replay = generate_rollouts(
        cold_engine,
        tokenizer,
        settings,
        next_turn(tokenizer, settings, history, streams),
        iteration=0,
        turn=1,
        policy_version="in-memory",
        earlier_turns=lambda: history,
    )
    assert replay == {"turns": 1, "max_abs_logprob_difference": 0.0}
    expected = uninterrupted.filter(lambda row: row["turn"] == 1, keep_in_memory=True)
    assert resumed["completion_token_ids"] == expected["completion_token_ids"]
    assert resumed["completion_logprobs"] == expected["completion_logprobs"]  # bit-identical floats


def test_a_full_context_ends_a_rollout_as_a_context_overflow_truncation_not_a_failure(tiny):
    """The calculator's prompt is 189 tokens. With a 250-token budget, completions are cut by the
    context (not by max_new_tokens); with 150, the prompt alone does not fit. Both are truncations
    (stop_reason context_overflow, scored with reward.truncated_reward), never failures."""
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    for max_context_tokens in (250, 150):
        config = RunConfig(
            task={"rollouts": 8, "group_size": 4, "max_turns": 4},
            generation={"max_new_tokens": 64, "max_context_tokens": max_context_tokens},
            reward={"truncated_reward": -0.5},
        )
        turns = run_episodes(engine, tokenizer, config)
        ends = {row["rollout_id"]: row for row in turns if row["stop_reason"] is not None}
        overflowed = [row for row in ends.values() if row["stop_reason"] == "context_overflow"]
        assert len(ends) == 8 and overflowed and not any(turns["failed"])
        assert all(row["reward"] == -0.5 and row["truncated"] for row in overflowed)
        for row in overflowed:
            used = row["stream_offset"] + len(row["context_token_ids"]) + len(row["completion_token_ids"])
            assert used + len(row["observation_token_ids"]) <= max_context_tokens or not row["completion_token_ids"]
    assert all(not row["completion_token_ids"] and row["finish_reason"] == "length" for row in overflowed)


def test_a_context_budget_beyond_the_models_positions_is_refused(tiny):
    from stages.generate_rollouts import GenerateSettings, first_turn, generate_rollouts

    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    settings = GenerateSettings.resolve(RunConfig(generation={"max_context_tokens": 8192}))
    pending = first_turn(tokenizer, settings, 0)
    with pytest.raises(ValueError, match=r"max_context_tokens \(8192\) exceeds .* \(4096 tokens\)"):
        generate_rollouts(engine, tokenizer, settings, pending, iteration=0, turn=0, policy_version="v")


def test_the_hf_engine_passes_its_kv_cache_without_a_deprecation_warning(tiny):
    """transformers 5.24 renamed the cache argument and output field to `cache`; the old name
    `past_key_values` warns (a FutureWarning on the argument, a logged warning on the output
    field) and is removed in 5.40. Two turns: the second continues the first's cache."""
    from transformers.utils import logging as transformers_logging

    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer.decode)
    prompt = tokenizer.encode("<|im_start|>user\nEvaluate 2+3.<|im_end|>\n<|im_start|>assistant\n")
    handler = RecordingHandler()
    transformers_logger = logging.getLogger("transformers")
    transformers_logging.warning_once.cache_clear()  # a message logged once already would not be logged again
    transformers_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (first,) = engine.sample([Request(0, prompt, 1, 8)], Sampling(1.0))
            assert engine.can_continue([Request(0, prompt + first.token_ids + prompt, 2, 8)])
            engine.sample([Request(0, prompt + first.token_ids + prompt, 2, 8)], Sampling(1.0))
    finally:
        transformers_logger.removeHandler(handler)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []
    assert [message for message in handler.messages if "deprecated" in message] == []


class RecordingHandler(logging.Handler):
    """Keeps the messages of a logger that does not propagate to pytest's caplog (transformers')."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def serve_in_order(engine, arrivals, follow_up):
    """engine.serve() with requests arriving at given steps (step -> requests); `follow_up(request,
    completion)` may return a request that arrives at the next step (an agent calling again at once), or
    (request, steps) for one that arrives that many steps later (an agent's tool taking its time).
    Returns [(step given, request, completion)] and the forward passes [(step, rows, most new tokens)]."""
    arrivals = {step: list(requests) for step, requests in arrivals.items()}
    step, given, by_tag, widths = 0, [], {}, []

    def take(idle):
        nonlocal step
        arrived = arrivals.pop(step, [])
        step += 1
        if not arrived and idle and not arrivals:
            return None  # nothing decodes, nothing will come
        by_tag.update((id(request), request) for request in arrived)
        return [(id(request), request) for request in arrived]

    def give(tag, completion):
        assert not isinstance(completion, Exception)
        given.append((step, by_tag[tag], completion))
        again = follow_up(by_tag[tag], completion)
        if again is not None:
            request, later = again if isinstance(again, tuple) else (again, 0)
            arrivals.setdefault(step + later, []).append(request)

    forward = hf_serve.forward

    def recorded(model, cache, blocks, pad_token_id, prefill):
        widths.append((step, len(blocks), max(map(len, blocks))))  # the tokens each row adds
        return forward(model, cache, blocks, pad_token_id, prefill)

    hf_serve.forward = recorded
    try:
        engine.serve(take, give, Sampling(1.0))
    finally:
        hf_serve.forward = forward
    return given, widths


def test_serve_batches_continuously_and_a_row_samples_the_same_bytes_whatever_shares_its_batch(tiny):
    """serve() (the agents' endpoint): requests join the batch while it decodes and each completion is
    given as soon as it ends; a rollout's next call, joining mid-decode, prefills only its new tokens
    after its kept row; and every call samples exactly the bytes (tokens and logprobs) it samples when
    its rollout is served alone, call after call: batch-invariant numbers."""
    model, tokenizer = tiny
    eos = eos_token_ids(tokenizer, model)
    prompts = [
        tokenizer.encode(f"<|im_start|>user\nEvaluate {a}*{a + 2}{' please' * a}.<|im_end|>\n<|im_start|>assistant\n")
        for a in range(6)
    ]
    follow = tokenizer.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")

    def call_again(request, completion):  # every rollout's agent calls once more, at once
        if request.seed != sampling_seed(0, 0, request.key, 0):
            return None
        context = request.token_ids + completion.token_ids + follow
        return Request(request.key, context, sampling_seed(0, 0, request.key, 1), 16)

    first = [Request(i, p, sampling_seed(0, 0, i, 0), 4 if i == 0 else 24) for i, p in enumerate(prompts)]
    engine = HFEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode)
    given, widths = serve_in_order(engine, {0: first[:3], 2: first[3:5], 9: first[5:]}, call_again)

    assert len(given) == 12
    order = [(request.key, request.seed) for _, request, _ in given]
    assert order.index((0, first[0].seed)) < order.index((1, first[1].seed))  # it did not wait for the long ones
    joined_at = next(s for s, request, _ in given if request is first[0])
    # rollout 0's second call joined while others decoded, and its prefill was its new tokens only
    assert any(s == joined_at + 1 and rows == 1 and width <= len(follow) + 1 for s, rows, width in widths)
    assert max(s for s, _, _ in given) > joined_at
    assert engine.model.config._attn_implementation != "mtrl_rows"  # the model as it was
    assert all("forward" not in vars(module) for module in engine.model.modules())

    for rollout in range(len(prompts)):  # each rollout alone, call after call, on a fresh engine
        alone_engine = HFEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode)
        alone, _ = serve_in_order(alone_engine, {0: [first[rollout]]}, call_again)
        batched = [(r.token_ids, c) for _, r, c in given if r.key == rollout]
        assert [(r.token_ids, c) for _, r, c in alone] == batched, rollout  # tokens and logprobs, exactly
    # and the same tokens as the engine's sample() re-encoding each context alone (its own attention)
    for _, request, completion in given:
        (cold,) = ColdEngine(model, tokenizer.pad_token_id, eos).sample([request], Sampling(1.0))
        assert completion.token_ids == cold.token_ids
        assert max(abs(a - b) for a, b in zip(completion.logprobs, cold.logprobs)) < 1e-4


def test_a_prefill_gives_the_same_bytes_alone_or_beside_longer_ones(tiny):
    """A call adding one token, prefilled alone or in a block beside calls adding more: the same logits
    to the last bit (a block is at least two tokens wide: row_attention tells it from a decode step)."""
    model, tokenizer = tiny
    prompt = tokenizer.encode("<|im_start|>user\nEvaluate 3*5.<|im_end|>\n<|im_start|>assistant\n")
    other = tokenizer.encode("<|im_start|>user\nEvaluate 12*12 please.<|im_end|>\n<|im_start|>assistant\n")
    pad = tokenizer.pad_token_id
    with torch.no_grad(), hf_serve.batch_invariant(model):
        kept = hf_serve.KeptRows(None)
        for key, tokens in ((0, prompt), (1, other[:-9])):  # each rollout's row after a first call
            cache, _, passes = hf_serve.admit(model, [Request(key, tokens, 1, 4)], kept, pad)
            kept.keep(key, hf_serve.KeptRow(tokens, passes[0], cache.row(0)))
        one_more = Request(0, prompt + [7], 2, 4)  # one token after its kept row
        nine_more = Request(1, other, 3, 4)  # nine tokens after its kept row
        _, alone, _ = hf_serve.admit(model, [one_more], kept, pad)
        _, together, _ = hf_serve.admit(model, [nine_more, one_more], kept, pad)
    assert torch.equal(alone[0], together[1])


class RandomAgents:
    """A seeded schedule of agents' calls for serve_in_order: `rollouts` rollouts in groups of 1-4 sharing
    a prompt of 15 to 500 tokens, each group's first calls arriving together at a random step of the
    first 12; each call's agent calls again after 0-4 steps (its tool), up to 3 calls, each call at most
    2-8 new tokens. Every choice is a function of the rollout and its call, not of the order the calls
    end in, so a rollout served alone makes the same calls."""

    FOLLOW = "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"

    def __init__(self, tokenizer, rollouts: int, seed: int):
        self.seed, self.follow = seed, tokenizer.encode(self.FOLLOW)
        draw = random.Random(seed)
        self.first: list[Request] = []
        self.arrivals: dict[int, list[Request]] = {}
        while len(self.first) < rollouts:
            a, b, steps = draw.randint(2, 99), draw.randint(2, 99), draw.choice([0, 2, 10, 40, 60])
            prompt = tokenizer.encode(
                f"<|im_start|>user\nEvaluate {a}*{b}.{' Show the steps.' * steps}<|im_end|>\n<|im_start|>assistant\n"
            )
            size = min(draw.randint(1, 4), rollouts - len(self.first))
            group = [self.call(len(self.first) + i, prompt, 0) for i in range(size)]
            self.first += group
            self.arrivals.setdefault(draw.randrange(12), []).extend(group)
        self.calls_of = {request.seed: 0 for request in self.first}  # a call's seed -> its index in its rollout

    def choice(self, key: int, call: int) -> random.Random:
        return random.Random(f"{self.seed}/{key}/{call}")

    def call(self, key: int, context: list[int], index: int) -> Request:
        budget = self.choice(key, index).randint(2, 8)
        return Request(key, context, sampling_seed(self.seed, 0, key, index), budget)

    def follow_up(self, request: Request, completion) -> tuple[Request, int] | None:
        index = self.calls_of[request.seed] + 1
        if index > self.choice(request.key, 0).randint(0, 2):
            return None
        again = self.call(request.key, request.token_ids + completion.token_ids + self.follow, index)
        self.calls_of[again.seed] = index
        return again, self.choice(request.key, index).randint(0, 4)


def test_calls_meeting_in_random_batches_give_the_bytes_their_rollout_gives_served_alone(tiny):
    """40 rollouts' calls (RandomAgents) meet in batches of 1 to 30-odd rows, join while others decode,
    share a cache with rows of 15 to 530 tokens: every call samples exactly the bytes (tokens and
    logprobs) it samples when its rollout is served alone, call after call. On the rules before this
    test (linear layers on at least 4 rows, attention over the whole cache width in one matmul) the
    logprobs of most calls differed in their last bits."""
    model, tokenizer = tiny
    eos = eos_token_ids(tokenizer, model)
    agents = RandomAgents(tokenizer, 40, seed=11)
    engine = HFEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode)
    given, passes = serve_in_order(engine, agents.arrivals, agents.follow_up)
    assert len({request.key for _, request, _ in given}) == 40 and len(given) > 60
    decode_rows = [rows for _, rows, width in passes if width == 1]
    assert min(decode_rows) < 6 and max(decode_rows) > 16  # the GEMMs' row counts crossed their thresholds
    assert max(len(request.token_ids) for request in agents.first) > 400  # rows past 384 columns
    for request in agents.first:
        engine = HFEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode)
        alone, _ = serve_in_order(engine, {0: [request]}, agents.follow_up)
        batched = [(r.token_ids, c) for _, r, c in given if r.key == request.key]
        assert [(r.token_ids, c) for _, r, c in alone] == batched, request.key  # tokens and logprobs, exactly


def test_a_kept_kv_budget_that_drops_rows_changes_no_byte(tiny):
    """With a budget of 0.25 MB for the kept rows (a row here takes 30 kB to 1.2 MB) the rows least recently
    used lose their keys and values, and their next call computes them again (a replay: more forward
    passes): every call gives the bytes it gives with no bound."""
    model, tokenizer = tiny
    eos = eos_token_ids(tokenizer, model)
    agents = RandomAgents(tokenizer, 16, seed=5)
    served = {}
    for budget in (None, 0.25):
        engine = HFEngine(model, tokenizer.pad_token_id, eos, tokenizer.decode, kept_kv_mb=budget)
        served[budget] = serve_in_order(engine, agents.arrivals, agents.follow_up)
    (unbounded, unbounded_passes), (bounded, bounded_passes) = served[None], served[0.25]
    assert len(bounded_passes) > len(unbounded_passes)  # rows were replayed
    assert [(r.token_ids, c) for _, r, c in bounded] == [(r.token_ids, c) for _, r, c in unbounded]


def test_a_server_that_dies_mid_answer_is_a_connection_error():
    """A vLLM server killed while it sends an answer cuts the body short: that must be an OSError, as
    every other broken exchange is (the engine names the dead server for those), not http.client's
    IncompleteRead, which escaped the engine as a bare traceback."""
    import socket
    import threading

    from stages.generate_rollouts.vllm_engine import post_json

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_half() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"ch')

    server = threading.Thread(target=answer_half, daemon=True)
    server.start()
    with listener, pytest.raises(ConnectionError, match="IncompleteRead"):
        post_json(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions", {"prompt": [1]}, timeout_s=10)
    server.join(timeout=10)
