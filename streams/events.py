"""The events the jobs' handlers take and give: each DESIGN topic's event type, decoded and
encoded with our codec (schemas/codec.py), and `Out`, one event to send.

No Faust here: the pure handlers (streams/batcher_state.py and the agents' `on_*` functions)
return `Out`s and the agents send them.
"""

from __future__ import annotations

from typing import Any

from schemas import topics
from schemas.codec import InvalidEvent, UndecodableEvent, codec

Out = tuple[str, bytes | None, bytes]
"""One event to send: (topic name, key, encoded value)."""

DECODE_ERRORS = (UndecodableEvent, InvalidEvent)
"""What decode_from raises for bytes that are not an event of the topic."""


def decode_from(topic: str, data: bytes | None) -> dict[str, Any]:
    """Decodes an event read from one of the DESIGN topics as that topic's event type."""
    return codec().decode(data, topics.EVENT_OF_TOPIC[topic])


def encode_for(topic: str, value: dict[str, Any]) -> bytes:
    """Encodes a value as the event type of a DESIGN topic (InvalidEvent when it does not fit)."""
    return codec().encode(topics.EVENT_OF_TOPIC[topic], value)
