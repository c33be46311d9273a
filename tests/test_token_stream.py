"""The embedded chat template renders Qwen3's format, and token-stream deltas reproduce it."""

from __future__ import annotations

import random

import datasets

from schemas.token_stream import generation_prompt_ids, observation_token_ids, prompt_token_ids, rollouts
from stages.environments import CalculatorEnv
from stages.tools import TOOLS, tool_schema

EXPECTED_EPISODE = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{TOOL}\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n<|im_start|>user\nEvaluate 19+74-98.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    'The user wants 19+74-98. I will use the calculate tool.\n</think>\n\n<tool_call>\n{"name": "calculate", '
    '"arguments": {"expression": "19+74-98"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-5\n'
    "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nThe tool returned -5.\n</think>\n\n"
    "The result is -5.<|im_end|>\n"
)


def episode():
    env = CalculatorEnv()
    task = {"question": "Evaluate 19+74-98.", "expression": "19+74-98", "answer": -5}
    return env, task, env.demonstration(task)


def test_embedded_template_renders_qwen3_format(tiny):
    _, tokenizer = tiny
    import json

    env, task, messages = episode()
    tools = [tool_schema(TOOLS["calculate"])]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == EXPECTED_EPISODE.replace("{TOOL}", json.dumps(tools[0], ensure_ascii=False))
    prompt = tokenizer.apply_chat_template(
        messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith(
        "<|im_start|>user\nEvaluate 19+74-98.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_assistant_mask_covers_exactly_the_assistant_output(tiny):
    _, tokenizer = tiny
    _, _, messages = episode()
    encoded = tokenizer.apply_chat_template(
        messages, tools=[tool_schema(TOOLS["calculate"])], return_assistant_tokens_mask=True, return_dict=True
    )
    masked = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    text = tokenizer.decode(masked)
    assert text.startswith("<think>\nThe user wants") and text.endswith("The result is -5.<|im_end|>")
    assert "<tool_response>" not in text and "<|im_start|>" not in text


def test_deltas_reproduce_the_rendered_conversation_token_for_token(tiny):
    """prompt + completion + observation + generation prompt + completion == the full render."""
    _, tokenizer = tiny
    _, _, messages = episode()
    tools = [tool_schema(TOOLS["calculate"])]
    full = tokenizer.apply_chat_template(messages, tools=tools, return_dict=True)["input_ids"]
    first_turn = tokenizer.apply_chat_template(messages[:3], tools=tools, return_dict=True)["input_ids"]

    stream = prompt_token_ids(tokenizer, messages[:2], tools, enable_thinking=True)
    # what the model samples in turn 1: the assistant output up to and including <|im_end|>
    completion_1 = first_turn[len(stream) : first_turn.index(tokenizer.eos_token_id, len(stream)) + 1]
    stream += completion_1
    stream += observation_token_ids(tokenizer, [messages[3]])
    stream += generation_prompt_ids(tokenizer, enable_thinking=True)
    completion_2 = full[len(stream) : full.index(tokenizer.eos_token_id, len(stream)) + 1]
    stream += completion_2
    assert stream == full[: len(stream)] and full[len(stream) :] == tokenizer.encode("\n", add_special_tokens=False)


def test_observation_of_several_tool_results_is_one_user_turn(tiny):
    _, tokenizer = tiny
    ids = observation_token_ids(tokenizer, [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    )


def test_calculator_env_samples_reproducibly():
    env = CalculatorEnv()
    a = [env.sample_task(random.Random(5)) for _ in range(2)]
    assert a[0] == a[1] and env.reward(a[0], {"content": f"The result is {a[0]['answer']}."}) == 1.0
    assert env.reward(a[0], {"content": f"<think>\n{a[0]['answer']}\n</think>\n\nI do not know."}) == 0.0


# ---------------------------------------------------------------------------------------
# The rollout view, on hand-built turns
# ---------------------------------------------------------------------------------------


def turn_rows(with_observations: bool = True) -> datasets.Dataset:
    """Three rollouts, rows shuffled: rollout 7 has three turns of different lengths, rollout 2
    one turn, rollout 5 two turns and a failed second turn."""
    rows = [
        # rollout_id, turn, failed, context, completion, observation
        (7, 1, False, [50], [51, 52, 53], [54, 55]),
        (2, 0, False, [1, 2], [3], []),
        (7, 0, False, [40, 41, 42], [43], [44]),
        (5, 1, True, [60], [], []),
        (7, 2, False, [56], [57, 58], []),
        (5, 0, False, [30], [31, 32], [33]),
    ]
    columns = {
        "rollout_id": [r[0] for r in rows],
        "turn": [r[1] for r in rows],
        "failed": [r[2] for r in rows],
        "context_token_ids": [r[3] for r in rows],
        "completion_token_ids": [r[4] for r in rows],
    }
    if with_observations:
        columns["observation_token_ids"] = [r[5] for r in rows]
    return datasets.Dataset.from_dict(columns)


def test_rollouts_rebuild_streams_and_spans_from_shuffled_ragged_turns():
    two, five, seven = rollouts(turn_rows())
    assert [r.rollout_id for r in (two, five, seven)] == [2, 5, 7]
    assert seven.rows == [2, 0, 4] and seven.turns == [0, 1, 2]
    # 40 41 42 | 43 | 44 || 50 | 51 52 53 | 54 55 || 56 | 57 58 |
    assert seven.token_ids == [40, 41, 42, 43, 44, 50, 51, 52, 53, 54, 55, 56, 57, 58]
    assert seven.context_spans == [(0, 3), (5, 6), (11, 12)]
    assert seven.completion_spans == [(3, 4), (6, 9), (12, 14)]
    assert seven.observation_spans == [(4, 5), (9, 11), (14, 14)]
    assert seven.stream_before(1) == [40, 41, 42, 43, 44, 50] and not seven.failed
    assert two.token_ids == [1, 2, 3] and two.rows == [1] and two.completion_spans == [(2, 3)]
    # a failed turn flags the whole rollout; its empty completion is an empty span
    assert five.failed and five.rows == [5, 3] and five.completion_spans == [(1, 3), (5, 5)]
    assert five.token_ids == [30, 31, 32, 33, 60]


def test_rollouts_of_a_generation_dataset_have_empty_observations():
    seven = rollouts(turn_rows(with_observations=False))[2]
    assert seven.token_ids == [40, 41, 42, 43, 50, 51, 52, 53, 56, 57, 58]
    assert seven.observation_spans == [(4, 4), (8, 8), (11, 11)]
    assert seven.stream_before(2) == [40, 41, 42, 43, 50, 51, 52, 53, 56]
