"""Chat-template encoding for the token-in, token-out agent loop (the template fingerprint is schemas/template.py).

ARCHITECTURE.md: the prompt is encoded once with the tokenizer's chat template and every environment
message is appended as the *difference* of two encodings. That only works when the template has
the prefix property: the encoding of a conversation starts with the encoding of any earlier
point of it. `extension` checks the property every time and raises TemplatePrefixError when a
template breaks it (Qwen3-style templates that rewrite earlier turns do), instead of silently
recording tokens that no re-encoding reproduces.

Untrusted text never becomes a control token. The whole rendered conversation is encoded at once,
so an environment answer (or a task text, or a tool-call argument the environment echoes back)
holding the string "<|im_end|>" would otherwise be encoded as the template's own end-of-turn id, and
the policy would read a forged turn boundary. `encode` therefore passes the content of every message
that is not the assistant's through `plain_text` first: each added-token string found there (the
tokenizer's added vocabulary: <|im_start|>, <tool_call>, ...) gets a zero-width space after its first
character, which the tokenizer spells with ordinary byte tokens and which decodes to text that reads
as the original; invalid UTF-8 becomes U+FFFD; NUL and the other control characters but tab, newline
and carriage return become visible escapes ("\\x00"). Assistant turns are left alone: their text is
the policy's own sampled ids decoded, which must re-encode to those very ids (a turn that spelled a
control token out byte by byte does not, and ends as invalid output; agent_loop.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from schemas.template import template_fingerprint

MARKER_BREAK = "\u200b"
"""Put after the first character of a control-token string in untrusted text: ZERO WIDTH SPACE is invisible,
is no whitespace to the pre-tokenizer's split and is left alone by NFC, so the string reads the same but no
longer matches the added token."""
_SURROGATES = re.compile("[\ud800-\udfff]")  # lone halves: what invalid UTF-8 decoded with surrogateescape leaves
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL, less \t \n \r


def marker_pattern(markers: Sequence[str]) -> re.Pattern[str] | None:
    """A regex matching any of `markers` (longest first), None when there is none to break.
    A one-character marker cannot be broken by an insertion and is left out."""
    breakable = sorted((m for m in markers if len(m) > 1), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, breakable))) if breakable else None


def plain_text(text: str | bytes, markers: re.Pattern[str] | None) -> str:
    """`text` made safe to render into a chat template: bytes decoded as UTF-8 (invalid sequences
    and lone surrogates become U+FFFD), control characters but tab, newline and carriage return
    written as visible escapes, and every match of `markers` broken by MARKER_BREAK after its first
    character. Idempotent: plain text comes back unchanged."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = _SURROGATES.sub("\ufffd", text)
    text = _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if markers is not None:
        # Again until none is left: breaking one match could only leave a marker inside its own tail.
        while markers.search(text):
            text = markers.sub(lambda m: m.group()[0] + MARKER_BREAK + m.group()[1:], text)
    return text


def bounded(message: Mapping[str, Any], max_chars: int) -> Mapping[str, Any]:
    """An environment `message` whose content holds at most `max_chars` characters (bytes decoded as
    UTF-8 first): a longer one keeps its head and a note saying how much was cut."""
    content = message.get("content")
    if isinstance(content, bytes):
        content = content.decode("utf-8", errors="replace")
    if not isinstance(content, str):
        return message
    if len(content) > max_chars:
        cut = len(content) - max_chars
        content = f"{content[:max_chars]}\n[... {cut} characters cut: the output was {len(content)} characters long]"
    return {**message, "content": content}


PIECE_CACHE_SIZE = 4096
"""Pieces of rendered conversations (ChatEncoder.encode_text) whose ids one encoder keeps: the system prompts
with their tool schemas and every message of the trajectories in flight, which each turn renders again."""


def piece_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Where a rendered conversation may be cut into pieces that encode independently: before every added
    token (the tokenizer splits its input on added tokens before anything else, so the text between two
    of them is encoded on its own either way). None, and the text is encoded whole, when an added token
    strips the whitespace beside it or must stand as a whole word: a cut would then change what it takes."""
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    if not added or any(getattr(t, "lstrip", True) or getattr(t, "rstrip", True) or getattr(t, "single_word", True)
                        for t in added):
        return None
    return marker_pattern([t.content for t in added])  # a one-character token left uncut is still encoded right


def pieces(text: str, pattern: re.Pattern[str]) -> list[str]:
    """`text` cut before every match of `pattern` (its pieces, in order, joined back give `text`)."""
    cuts = [0, *(m.start() for m in pattern.finditer(text) if m.start() > 0), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


class TemplatePrefixError(ValueError):
    """The chat template rendered an earlier part of the conversation differently once more was appended."""


class ChatTokenizer(Protocol):
    """What the loop needs of a transformers tokenizer."""

    chat_template: str | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def encode(self, text: str, **kwargs: Any) -> list[int]: ...
    def decode(self, ids: Any, **kwargs: Any) -> str: ...
    def get_added_vocab(self) -> dict[str, int]: ...


class ChatEncoder:
    """Encodes conversations with one tokenizer's chat template (rendered text -> ids, no special tokens added)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.fingerprint = template_fingerprint(tokenizer)
        self.markers = marker_pattern(list(tokenizer.get_added_vocab()))
        # Every turn renders the whole conversation again; encoding it piece by piece with the pieces' ids
        # kept costs only the new pieces (the history's re-encoding was most of the loop's CPU per turn).
        self._pieces = piece_pattern(tokenizer)
        self._encode_piece = functools.lru_cache(maxsize=PIECE_CACHE_SIZE)(self._encode_whole)
        # What the template writes after an assistant turn's content ("<|im_end|>\n" for Qwen):
        # the loop keeps room for it so closing a turn never overruns max_total_len.
        probe = [{"role": "user", "content": "x"}]
        self.assistant_close = self.extension(
            self.encode(probe, None, True), [*probe, {"role": "assistant", "content": ""}], None, False
        )

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """Token ids of the rendered conversation, every content but the assistant's made `plain_text`."""
        text = self.tokenizer.apply_chat_template(
            [self.untrusted(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return self.encode_text(text)

    def untrusted(self, message: Mapping[str, Any]) -> Mapping[str, Any]:
        """`message` with its content made `plain_text`, unless it is the assistant's (the policy's own ids)."""
        content = message.get("content")
        if message.get("role") == "assistant" or not isinstance(content, (str, bytes)):
            return message
        return {**message, "content": plain_text(content, self.markers)}

    def encode_text(self, text: str) -> list[int]:
        if self._pieces is None:
            return list(self._encode_whole(text))
        ids: list[int] = []
        for piece in pieces(text, self._pieces):
            ids += self._encode_piece(piece)
        return ids

    def _encode_whole(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens kept (tool-call tags are added tokens)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def extension(
        self,
        base_ids: Sequence[int],
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """encode(messages) minus `base_ids`; raises TemplatePrefixError unless encode(messages) starts with them."""
        full = self.encode(messages, tools, add_generation_prompt)
        cut = len(base_ids)
        if full[:cut] != list(base_ids):
            mismatch = next((i for i, (a, b) in enumerate(zip(full, base_ids)) if a != b), min(len(full), cut))
            raise TemplatePrefixError(
                f"the chat template breaks the prefix property: re-encoding the conversation with "
                f"{len(messages)} messages differs from the recorded tokens at position {mismatch} "
                f"(recorded {cut} tokens, re-encoded {len(full)}); the token-in, token-out loop cannot "
                f"use this template"
            )
        return full[cut:]
