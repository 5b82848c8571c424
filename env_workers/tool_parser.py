"""Tool calls from assistant text: Qwen2.5's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Pure. A message the parser cannot read is the policy's mistake, so it never raises: it returns
the reason as text, which the agent loop shows to the policy as an environment error message
(and counts). Parsing is all-or-nothing: one bad block rejects the message's calls, so the policy
never gets half of what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant turn as the environment sees it: text outside the call blocks, and the calls."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI assistant message (tool_calls only when there are some)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _split_blocks(text: str) -> tuple[list[str], list[str]] | str:
    """(texts outside blocks, block bodies), or the error when the tags do not pair up."""
    outside: list[str] = []
    bodies: list[str] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        stray_close = text.find(TOOL_CALL_CLOSE, position)
        if start < 0:
            if stray_close >= 0:
                return f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"
            outside.append(text[position:])
            return outside, bodies
        if 0 <= stray_close < start:
            return f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            return f"unterminated {TOOL_CALL_OPEN} block (missing {TOOL_CALL_CLOSE})"
        body = text[start + len(TOOL_CALL_OPEN):end]
        if TOOL_CALL_OPEN in body:
            return f"unterminated {TOOL_CALL_OPEN} block (a second {TOOL_CALL_OPEN} before {TOOL_CALL_CLOSE})"
        outside.append(text[position:start])
        bodies.append(body)
        position = end + len(TOOL_CALL_CLOSE)


def _parse_call(body: str, index: int) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of one block body, or the error."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return f"tool call {index} is not valid JSON ({error.msg} at position {error.pos})"
    if not isinstance(call, dict):
        return f'tool call {index} must be a JSON object {{"name": ..., "arguments": {{...}}}}'
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return f'tool call {index} has no "name" string'
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return f'"arguments" of tool call {index} ({name}) must be a JSON object'
    return name, arguments


def parse_tool_calls(text: str, call_id_prefix: str = "call") -> ParsedMessage:
    """Parses every `<tool_call>` block of `text` into OpenAI tool_calls with ids `{prefix}_{i}`."""
    split = _split_blocks(text)
    if isinstance(split, str):
        return ParsedMessage(content=text.strip(), error=split)
    outside, bodies = split
    content = "".join(outside).strip()
    calls: list[dict[str, Any]] = []
    for index, body in enumerate(bodies):
        parsed = _parse_call(body, index)
        if isinstance(parsed, str):
            return ParsedMessage(content=text.strip(), error=parsed)
        name, arguments = parsed
        calls.append({
            "id": f"{call_id_prefix}_{index}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        })
    return ParsedMessage(content=content, tool_calls=calls)


def parse_error_message(error: str) -> dict[str, Any]:
    """The environment message the policy sees when its tool calls could not be parsed."""
    return {
        "role": "user",
        "content": f"Error: your tool call could not be parsed: {error}. Write each call as "
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}',
    }
