"""Parsing Qwen2.5-style tool calls from assistant text: every malformed case is an error string, never an exception."""

from __future__ import annotations

import json

import pytest

from env_workers.tool_parser import parse_error_message, parse_tool_calls


def test_one_call_becomes_an_openai_tool_call_and_the_rest_is_content():
    parsed = parse_tool_calls('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "call_0")
    assert parsed.error is None and parsed.content == "I will add."
    assert parsed.tool_calls == [{"id": "call_0_0", "type": "function",
                                  "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]


def test_several_calls_keep_their_order_and_get_distinct_ids():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": "é"}}</tool_call>')
    calls = parse_tool_calls(text, "call_3").tool_calls
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("call_3_0", "a"), ("call_3_1", "b")]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": "é"}


def test_missing_arguments_mean_an_empty_object():
    parsed = parse_tool_calls('<tool_call>{"name": "list_tables"}</tool_call>')
    assert parsed.error is None and parsed.tool_calls[0]["function"]["arguments"] == "{}"


def test_text_without_calls_is_plain_content():
    parsed = parse_tool_calls("  Final Answer: #3  ")
    assert (parsed.content, parsed.tool_calls, parsed.error) == ("Final Answer: #3", [], None)
    assert parsed.as_openai() == {"role": "assistant", "content": "Final Answer: #3"}


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>["add", {"a": 1}]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": {}}', "unterminated"),
    ('<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call>', "unterminated"),
    ('{"name": "add"}</tool_call>', "without a matching"),
], ids=["bad-json", "no-name", "empty-name", "string-arguments", "list-arguments", "not-an-object",
        "unterminated", "nested-open", "stray-close"])
def test_malformed_call_is_an_error_string_and_no_calls(text, reason):
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == [] and reason in parsed.error


def test_one_bad_block_rejects_every_call_of_the_message():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == [] and "tool call 1" in parsed.error


def test_parse_error_message_is_a_user_turn_that_shows_the_expected_format():
    message = parse_error_message("tool call 0 is not valid JSON")
    assert message["role"] == "user"
    assert "tool call 0 is not valid JSON" in message["content"] and "<tool_call>" in message["content"]
