"""Serialization at the Faust edge: raw-bytes topics and a bytes-safe codec for table values.

Every topic the streams app reads or writes carries bytes: our Avro single-object encoding
(schemas/codec.py, by topic in streams/events.py) is applied inside the agents, per event, so an undecodable event is caught
there and routed to `dlq` with its reason instead of failing in Faust's deserializer (which
would ack and drop it). Raw bytes also let an agent forward an event without re-encoding it.

Table values are plain dicts that may hold bytes (packed token arrays, raw encoded events), which
Faust's default JSON codec cannot carry; `TaggedJSON` writes bytes as {"$b": base64} instead.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import orjson

from faust.serializers.codecs import Codec

RAW = "raw"
_BYTES_TAG = "$b"


def _default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {_BYTES_TAG: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and _BYTES_TAG in obj:
        return base64.b64decode(obj[_BYTES_TAG])
    return obj


class TaggedJSON(Codec):
    """JSON with bytes as {"$b": base64}: table values survive the changelog byte-exact.

    Written with orjson: every table write is encoded in the worker's one Python thread, and
    orjson encodes a group's state much faster than the standard library (bench streams). Keys
    that are not strings are written as strings, as the standard library does; NaN and infinities,
    which no table holds, would be written as null."""

    def _dumps(self, obj: Any) -> bytes:
        return orjson.dumps(obj, default=_default, option=orjson.OPT_NON_STR_KEYS)

    def _loads(self, s: bytes) -> Any:
        return json.loads(s, object_hook=_hook)


def tagged_table(app: Any, name: str, partitions: int, topic_config: dict[str, str]) -> Any:
    """A Faust table of str keys whose values are dicts that may hold bytes (TaggedJSON)."""
    table = app.Table(name, partitions=partitions, key_type=str, extra_topic_configs=topic_config)
    # Faust derives the value codec from value_type (a Record's serializer) and takes no codec
    # argument. Writes and the store read this attribute; the changelog topic, which recovery reads
    # back with its own serializer, is already built when the table is (with plain JSON, which gave
    # a recovered table {"$b": ...} dicts where it had bytes), so it is derived again.
    table.value_serializer = TaggedJSON()
    table.changelog_topic = table.changelog_topic.derive(value_serializer=table.value_serializer)
    return table


def raw_table(app: Any, name: str, partitions: int, topic_config: dict[str, str]) -> Any:
    """A Faust table of str keys and raw bytes values (encoded events kept as received)."""
    return app.Table(name, partitions=partitions, key_type=str, value_type=bytes, extra_topic_configs=topic_config)
