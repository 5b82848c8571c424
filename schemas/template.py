"""The chat-template fingerprint: part of the contract between the rollout side and the learner.

Every trajectory carries the fingerprint of the template that encoded it (env_workers/); the
learner compares it with its own tokenizer's before training on it (learner/), because token ids
encoded under another template or tokenizer mean something else to the model being trained.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol


class TemplateSource(Protocol):
    """What the fingerprint reads from a tokenizer (Hugging Face tokenizers have all three)."""

    chat_template: str | None
    eos_token_id: int | None

    def get_added_vocab(self) -> dict[str, int]: ...


def template_fingerprint(tokenizer: TemplateSource) -> str:
    """sha256 of the chat template, the added tokens and eos: equal fingerprints encode conversations alike."""
    identity: dict[str, Any] = {
        "chat_template": tokenizer.chat_template,
        "added_tokens": sorted(tokenizer.get_added_vocab().items(), key=lambda item: item[1]),
        "eos_token_id": tokenizer.eos_token_id,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
