"""What a replay yields: a decoded record with where it was read, the bounds of a replay, the
records it could not decode or whose payload is gone, and its counters.

No Kafka here (pipeline/analysis/replay.py reads the topics).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from schemas import topics

_UNDECODABLE_EXAMPLES = 20


@dataclass(frozen=True)
class ReplayRecord:
    """One decoded event with where it was read."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: dict[str, Any]


@dataclass(frozen=True)
class Bound:
    """Where a replay starts (inclusive) or stops (exclusive): the same offset in every partition,
    or a record timestamp (the first offset whose timestamp is at or after it, per partition)."""

    offset: int | None = None
    timestamp_ms: int | None = None

    def __post_init__(self) -> None:
        if (self.offset is None) == (self.timestamp_ms is None):
            raise ValueError("a bound is either an offset or a timestamp")
        if (self.offset if self.offset is not None else self.timestamp_ms) < 0:
            raise ValueError("a bound cannot be negative")

    @classmethod
    def parse(cls, text: str) -> Bound:
        """An integer is an offset; anything else must be an ISO-8601 time (UTC when no zone is given)."""
        text = text.strip()
        if text.lstrip("-").isdigit():
            return cls(offset=int(text))
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{text!r} is neither an offset nor an ISO-8601 time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return cls(timestamp_ms=int(round(when.timestamp() * 1000)))


@dataclass(frozen=True)
class UndecodableRecord:
    """Where an undecodable record sits and why it does not decode."""

    topic: str
    partition: int
    offset: int
    reason: str


@dataclass(frozen=True)
class MissingPayload:
    """A claim-checked batch whose stored object no longer exists (expired with the payload bucket's
    lifecycle rule, or deleted): its row holds the claim check alone, without items."""

    topic: str
    partition: int
    offset: int
    batch_id: str
    uri: str


@dataclass
class ReplayStats:
    """Counters of one or more replays, filled in while they read. Undecodable records are never
    yielded (replay is read-only, so they are not dead-lettered either): they are counted here."""

    planned: int = 0
    """Offsets in the ranges to read, summed over partitions (compacted topics hold fewer records)."""
    read: int = 0
    """Records read."""
    kept: int = 0
    """Records yielded."""
    other_runs: int = 0
    """Decoded records skipped because they belong to another run."""
    undecodable: int = 0
    """Records that did not decode, of any run."""
    undecodable_by_topic: dict[str, int] = field(default_factory=dict)
    """The same, per topic."""
    undecodable_examples: list[UndecodableRecord] = field(default_factory=list)
    """The first few undecodable records."""
    missing_payloads: list[MissingPayload] = field(default_factory=list)
    """Every claim-checked batch whose stored object is gone (yielded without its items)."""

    def add_undecodable(self, record: UndecodableRecord) -> None:
        self.undecodable += 1
        self.undecodable_by_topic[record.topic] = self.undecodable_by_topic.get(record.topic, 0) + 1
        if len(self.undecodable_examples) < _UNDECODABLE_EXAMPLES:
            self.undecodable_examples.append(record)


def run_of(topic: str, value: Mapping[str, Any]) -> str | None:
    """The run an event belongs to; None for events that carry none (dead letters, and engine
    heartbeats written before they carried a run, whose run is empty)."""
    if topic == topics.TASKS:
        return value["request"]["run"]
    return value.get("run") or None
