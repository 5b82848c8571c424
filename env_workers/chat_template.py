"""Chat-template encoding for the token-in, token-out agent loop (the template fingerprint is schemas/template.py).

ARCHITECTURE.md: the prompt is encoded once with the tokenizer's chat template and every environment
message is appended as the *difference* of two encodings. That only works when the template has
the prefix property: the encoding of a conversation starts with the encoding of any earlier
point of it. `extension` checks the property every time and raises TemplatePrefixError when a
template breaks it (Qwen3-style templates that rewrite earlier turns do), instead of silently
recording tokens that no re-encoding reproduces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from schemas.template import template_fingerprint


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
        """Token ids of the rendered conversation."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
