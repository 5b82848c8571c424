"""The default chat template (Qwen2.5 style, with tools) and the incremental encoding helpers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import AddedToken

from env_workers.chat_template import ChatEncoder, TemplatePrefixError, piece_pattern, pieces
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


# --- encoding a rendered conversation piece by piece ------------------------------------------------------

PIECEWISE_TEXTS = [
    "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\n",
    "no added token at all, just text  with  spaces\n\n",
    "<tool_call><tool_call></tool_call>",  # added tokens back to back
    "  leading spaces<|im_end|>   trailing spaces  ",
    "e\u0301<tool_call>cafe\u0301\n</tool_call>\u00e9",  # NFC-composable marks beside added tokens
    "<|im_start|<|im_start|>|im_end|>",  # a near miss just before a real token
    "数字 123 <tool_response>\n{\"a\": [1, 2]}\n</tool_response><|endoftext|>",
]


@pytest.mark.parametrize("text", PIECEWISE_TEXTS)
def test_encoding_piece_by_piece_gives_the_ids_of_encoding_the_whole_text(encoder, text):
    whole = list(encoder.tokenizer.encode(text, add_special_tokens=False))
    assert encoder.encode_text(text) == whole
    assert encoder.encode_text(text) == whole  # and again, from the kept pieces


def test_a_whole_conversation_encodes_piece_by_piece_as_it_does_whole(encoder):
    for end in range(1, len(CONVERSATION) + 1):
        text = encoder.tokenizer.apply_chat_template(CONVERSATION[:end], tools=TOOLS, tokenize=False)
        assert encoder.encode_text(text) == list(encoder.tokenizer.encode(text, add_special_tokens=False))


def test_pieces_join_back_and_each_after_the_first_starts_at_an_added_token():
    pattern = piece_pattern(build_tokenizer())
    text = "head<|im_start|>a<tool_call>b</tool_call><|im_end|>"
    cut = pieces(text, pattern)
    assert "".join(cut) == text
    assert cut == ["head", "<|im_start|>a", "<tool_call>b", "</tool_call>", "<|im_end|>"]
    assert pieces("<|im_end|>x", pattern) == ["<|im_end|>x"]


class _CountingTokenizer:
    """build_tokenizer's, counting the texts it encodes."""

    def __init__(self, inner) -> None:
        self._inner, self.encoded = inner, []
        self.chat_template, self.eos_token_id = inner.chat_template, inner.eos_token_id
        self.added_tokens_decoder = inner.added_tokens_decoder

    def apply_chat_template(self, conversation, **kwargs):
        return self._inner.apply_chat_template(conversation, **kwargs)

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self._inner.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self._inner.decode(ids, **kwargs)

    def get_added_vocab(self):
        return self._inner.get_added_vocab()


def test_re_encoding_a_conversation_with_one_more_message_encodes_only_the_new_pieces():
    tokenizer = _CountingTokenizer(build_tokenizer())
    encoder = ChatEncoder(tokenizer)
    encoder.encode(CONVERSATION[:2], TOOLS, True)
    tokenizer.encoded.clear()
    encoder.encode(CONVERSATION[:3], TOOLS, False)
    # Only the assistant's turn is new: the system prompt with its tool schemas is not encoded again.
    assert tokenizer.encoded and all("# Tools" not in text and "How many rows?" not in text
                                     for text in tokenizer.encoded)


def test_an_added_token_that_strips_whitespace_leaves_the_text_to_be_encoded_whole():
    stripping = SimpleNamespace(added_tokens_decoder={259: AddedToken("<tool_call>", lstrip=True)})
    assert piece_pattern(stripping) is None
    assert piece_pattern(SimpleNamespace(added_tokens_decoder={})) is None
