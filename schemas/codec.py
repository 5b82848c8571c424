"""The one codec for every rollstream event: Avro single-object encoding with fastavro.

Wire format (Avro specification, "Single-object encoding"): the two marker bytes C3 01, the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing canonical form, then
the Avro binary body. A reader finds the writer schema by its fingerprint among the current and
historical schemas, and resolves the event against its own (current) schema, so events written
by an older producer still decode after the schema gained fields.

Evolution rule: fields are only added, always with a default. When a schema changes, its
previous version is copied to `avro/history/<event>.v<N>.avsc` first, so its fingerprint stays
known; tests decode events written with every historical version.

Every failure to decode raises `UndecodableEvent` with a readable reason, so consumers can send
the original bytes to the dead-letter topic.
"""

from __future__ import annotations

import copy
import io
import json
import struct
from functools import cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form
from fastavro.validation import ValidationError, validate

SCHEMA_DIR = Path(__file__).parent / "avro"
HISTORY_DIR = SCHEMA_DIR / "history"
MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
NAMESPACE = "rollstream.events"

# Schema files in dependency order: a named type is declared before any schema refers to it.
SCHEMA_FILES: tuple[str, ...] = (
    "pool", "status", "task_requested", "task", "step", "trajectory", "group", "batch",
    "weight_version", "engine_heartbeat", "metric", "alert", "dead_letter",
)
# Named types that are not events of their own.
_SUPPORT_TYPES = frozenset({"pool", "status"})
EVENT_TYPES: tuple[str, ...] = tuple(n for n in SCHEMA_FILES if n not in _SUPPORT_TYPES)


class UndecodableEvent(ValueError):
    """Bytes that are not a valid event of the expected type. `reason` says why, readably."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidEvent(ValueError):
    """A value that does not match its schema, refused before it is written."""


def _full_name(schema: dict[str, Any]) -> str:
    name = schema["name"]
    return name if "." in name else f"{schema.get('namespace', NAMESPACE)}.{name}"


def _expand(node: Any, named: dict[str, dict], seen: set[str]) -> Any:
    """Inlines named-type references at their first use, so every event schema stands alone
    (other Avro implementations and the canonical form need no external definitions)."""
    if isinstance(node, str):
        full = node if "." in node else f"{NAMESPACE}.{node}"
        if full in named and full not in seen:
            seen.add(full)
            return _expand(copy.deepcopy(named[full]), named, seen)
        return node
    if isinstance(node, list):
        return [_expand(n, named, seen) for n in node]
    if isinstance(node, dict):
        out = dict(node)
        if out.get("type") in ("record", "enum", "fixed") and "name" in out:
            seen.add(_full_name(out))
        if "type" in out:
            out["type"] = _expand(out["type"], named, seen)
        if "fields" in out:
            out["fields"] = [_expand(f, named, seen) for f in out["fields"]]
        if "items" in out:
            out["items"] = _expand(out["items"], named, seen)
        if "values" in out:
            out["values"] = _expand(out["values"], named, seen)
        return out
    return node


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _fingerprint(expanded: dict[str, Any]) -> bytes:
    parsed = fastavro.parse_schema(copy.deepcopy(expanded), _write_hint=False)
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


class EventCodec:
    """Encodes and decodes every event type. Build it once (`codec()`), share it."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        history_dir = schema_dir / "history"
        named: dict[str, dict] = {}
        for name in SCHEMA_FILES:
            raw = _load(schema_dir / f"{name}.avsc")
            named[_full_name(raw)] = raw
        self._named = named
        self._schemas: dict[str, dict[str, Any]] = {}      # event type -> expanded JSON schema
        self._parsed: dict[str, Any] = {}                  # event type -> fastavro parsed schema
        self._fingerprints: dict[str, bytes] = {}           # event type -> current fingerprint
        self._writers: dict[bytes, tuple[str, Any]] = {}    # fingerprint -> (event type, parsed)
        self._history: dict[tuple[str, int], tuple[bytes, Any]] = {}  # (type, version) -> (fp, parsed)
        for event_type in EVENT_TYPES:
            raw = _load(schema_dir / f"{event_type}.avsc")
            expanded = _expand(raw, named, set())
            self._register(event_type, expanded, current=True)
        for path in sorted(history_dir.glob("*.avsc")) if history_dir.exists() else []:
            event_type = path.name.split(".")[0]
            if event_type not in self._schemas:
                raise ValueError(f"history schema {path.name} names no current event type")
            version = int(path.name.split(".")[1].lstrip("v"))
            fp, parsed = self._register(event_type, _expand(_load(path), named, set()), current=False)
            self._history[(event_type, version)] = (fp, parsed)

    def _register(self, event_type: str, expanded: dict[str, Any], *, current: bool) -> tuple[bytes, Any]:
        parsed = fastavro.parse_schema(copy.deepcopy(expanded))
        fp = _fingerprint(expanded)
        if fp in self._writers and self._writers[fp][0] != event_type:
            raise ValueError(f"schemas {event_type} and {self._writers[fp][0]} share a fingerprint")
        self._writers[fp] = (event_type, parsed)
        if current:
            self._schemas[event_type] = expanded
            self._parsed[event_type] = parsed
            self._fingerprints[event_type] = fp
        return fp, parsed

    # -- introspection -------------------------------------------------------------------
    def schema(self, event_type: str) -> dict[str, Any]:
        """The current schema of `event_type` as self-contained Avro JSON."""
        return copy.deepcopy(self._schemas[self._check_type(event_type)])

    def fingerprint(self, event_type: str) -> bytes:
        return self._fingerprints[self._check_type(event_type)]

    def known_fingerprints(self) -> dict[bytes, str]:
        return {fp: et for fp, (et, _) in self._writers.items()}

    def _check_type(self, event_type: str) -> str:
        if event_type not in self._schemas:
            raise KeyError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}")
        return event_type

    # -- encode / decode -----------------------------------------------------------------
    def encode(self, event_type: str, value: dict[str, Any], *, schema_version: int | None = None) -> bytes:
        """Validates `value` against the current schema (or the historical `schema_version` in
        avro/history/, as an older producer would write it) and returns its single-object encoding."""
        self._check_type(event_type)
        if schema_version is None:
            fp, parsed = self._fingerprints[event_type], self._parsed[event_type]
        elif (event_type, schema_version) in self._history:
            fp, parsed = self._history[(event_type, schema_version)]
        else:
            raise KeyError(f"no history schema {event_type}.v{schema_version}.avsc")
        # A valid value is checked without raise_errors: with it, fastavro raises, and formats the
        # datum as JSON, for every union branch a field does not take (the null of every optional
        # field set), which cost about as much as writing the event. Only an invalid
        # value is checked again, for the message.
        if not validate(value, parsed, raise_errors=False):
            try:
                validate(value, parsed, raise_errors=True)
            except ValidationError as e:
                raise InvalidEvent(f"{event_type}: {e}") from None
            raise InvalidEvent(f"{event_type}: not valid against its schema")
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(fp)
        fastavro.schemaless_writer(buf, parsed, value)
        return buf.getvalue()

    def decode(self, data: bytes | None, event_type: str | None = None) -> dict[str, Any]:
        """Decodes one event. With `event_type`, the writer's event is resolved against that
        type's current schema (and must be of that type); without, it is read as written.
        Raises UndecodableEvent for anything else."""
        writer_type, writer, body = self._header(data)
        if event_type is None:
            reader = self._parsed[writer_type]
        else:
            if writer_type != self._check_type(event_type):
                raise UndecodableEvent(f"expected a {event_type} event, got a {writer_type} event")
            reader = self._parsed[event_type]
        buf = io.BytesIO(body)
        try:
            value = fastavro.schemaless_reader(buf, writer, reader)
        except Exception as e:  # fastavro raises many types for corrupt bodies
            raise UndecodableEvent(f"corrupt {writer_type} body: {type(e).__name__}: {e}") from None
        if buf.tell() != len(body):
            raise UndecodableEvent(f"{len(body) - buf.tell()} trailing bytes after a {writer_type} event")
        return value

    def event_type_of(self, data: bytes | None) -> str:
        """The event type an encoded event was written as (from its fingerprint)."""
        return self._header(data)[0]

    def _header(self, data: bytes | None) -> tuple[str, Any, bytes]:
        if data is None:
            raise UndecodableEvent("empty value (tombstone or null)")
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise UndecodableEvent(
                f"not an Avro single-object encoding: starts with {bytes(data[:2]).hex() or 'nothing'}, "
                f"expected c301 and an 8-byte fingerprint ({len(data)} bytes in all)")
        fp = bytes(data[2:HEADER_LEN])
        if fp not in self._writers:
            raise UndecodableEvent(f"unknown schema fingerprint {struct.unpack('<Q', fp)[0]:016x}")
        event_type, writer = self._writers[fp]
        return event_type, writer, bytes(data[HEADER_LEN:])


@cache
def codec() -> EventCodec:
    """The process-wide codec over the packaged schemas."""
    return EventCodec()


def encode(event_type: str, value: dict[str, Any]) -> bytes:
    return codec().encode(event_type, value)


def decode(data: bytes | None, event_type: str | None = None) -> dict[str, Any]:
    return codec().decode(data, event_type)
