"""The default chat template (Qwen2.5 style, with tools) and the incremental encoding helpers."""

from __future__ import annotations

import pytest

from env_workers.chat_template import ChatEncoder, TemplatePrefixError
from schemas.template import template_fingerprint
from pipeline.policy.model_init import CHAT_TEMPLATE, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "execute_sql", "description": "Run SQL.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are a database agent."},
    {"role": "user", "content": "How many rows?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c0", "type": "function",
                     "function": {"name": "execute_sql", "arguments": {"query": "SELECT 1"}}},
                    {"id": "c1", "type": "function",
                     "function": {"name": "execute_sql", "arguments": '{"query": "SELECT 2"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "1"},
    {"role": "tool", "tool_call_id": "c1", "content": "2"},
    {"role": "assistant", "content": "There are 3."},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(build_tokenizer())


def render(encoder: ChatEncoder, messages, tools=TOOLS, add_generation_prompt=False) -> str:
    return encoder.decode(encoder.encode(messages, tools, add_generation_prompt))


def test_tools_are_listed_in_the_system_turn_as_qwen25_does(encoder):
    text = render(encoder, CONVERSATION[:2], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a database agent.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "execute_sql"' in text
    assert text.endswith("<|im_start|>user\nHow many rows?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_calls_render_in_qwen25_format_with_dict_or_string_arguments(encoder):
    text = render(encoder, CONVERSATION[:3])
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "execute_sql", "arguments": {"query": "SELECT 1"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "execute_sql", "arguments": {"query": "SELECT 2"}}\n</tool_call><|im_end|>\n')


def test_consecutive_tool_results_share_one_user_turn(encoder):
    text = render(encoder, CONVERSATION[:5])
    assert text.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                         "</tool_response><|im_end|>\n")


def test_default_system_prompt_without_system_message_or_tools(encoder):
    text = render(encoder, [{"role": "user", "content": "hi"}], tools=None)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_every_turn_boundary_of_a_conversation_is_a_prefix_of_the_whole(encoder):
    whole = encoder.encode(CONVERSATION, TOOLS, False)
    for end in range(2, len(CONVERSATION)):
        if CONVERSATION[end]["role"] == "tool":
            continue  # a tool turn is only closed once the next message is not a tool result
        assert whole[:len(encoder.encode(CONVERSATION[:end], TOOLS, False))] == encoder.encode(
            CONVERSATION[:end], TOOLS, False)


def test_extension_is_the_difference_of_two_encodings(encoder):
    base = encoder.encode(CONVERSATION[:3], TOOLS, False)
    delta = encoder.extension(base, CONVERSATION[:5], TOOLS, True)
    assert base + delta == encoder.encode(CONVERSATION[:5], TOOLS, True)
    assert encoder.decode(delta).startswith("<|im_start|>user\n<tool_response>")
    assert encoder.decode(delta).endswith("<|im_start|>assistant\n")


def test_extension_raises_when_the_recorded_tokens_are_not_a_prefix(encoder):
    base = encoder.encode(CONVERSATION[:3], TOOLS, False)
    with pytest.raises(TemplatePrefixError, match="prefix property"):
        encoder.extension([*base[:-3], 0, 0, 0], CONVERSATION[:5], TOOLS, True)


def test_assistant_close_is_im_end_and_newline(encoder):
    assert encoder.decode(encoder.assistant_close) == "<|im_end|>\n"


def test_fingerprint_is_stable_and_changes_with_the_template():
    first, second = build_tokenizer(), build_tokenizer()
    assert template_fingerprint(first) == template_fingerprint(second)
    second.chat_template = CHAT_TEMPLATE.replace("helpful", "terse")
    assert template_fingerprint(first) != template_fingerprint(second)
    assert len(template_fingerprint(first)) == 64


def test_encoder_refuses_a_tokenizer_without_a_chat_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatEncoder(tokenizer)


def test_decode_keeps_control_tokens_so_tool_calls_can_be_parsed(encoder):
    ids = encoder.encode_text('<tool_call>\n{"name": "x"}\n</tool_call>')
    assert len(ids) == len('\n{"name": "x"}\n') + 2
    assert encoder.decode(ids) == '<tool_call>\n{"name": "x"}\n</tool_call>'
