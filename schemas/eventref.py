"""References to events by where Kafka holds them: `kafka://TOPIC/PARTITION/OFFSET`.

Why: a trajectory's token arrays (8k tokens are ~70 kB) are written once, to `trajectories`.
The stream processor only needs their counts, so it carries each trajectory onwards without its
arrays and with `arrays_uri` pointing at the `trajectories` event it read; `groups` and `batches`
stay small and the processor moves kilobytes per trajectory instead of copying the arrays into
every internal topic, changelog, group and batch (it sustained about half the rate with them).
Whoever needs the arrays (the learner, replay) reads them back from that event: Kafka keeps
`trajectories` for the run's retention, and an offset names exactly one event, so the arrays read
are those of the very event the aggregator counted (a re-rollout under the same id is a different
event, at another offset).

`parse`/`uri` are pure; `EventFetcher` reads referenced events, a range per partition at a time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas.settings import KafkaSettings

SCHEME = "kafka://"
MAX_GAP = 256
"""Offsets at most this far apart in one partition are read as one range rather than seeked to."""


def uri(topic: str, partition: int, offset: int) -> str:
    """The reference of the event at (topic, partition, offset)."""
    return f"{SCHEME}{topic}/{partition}/{offset}"


def is_ref(value: str | None) -> bool:
    """Whether an arrays_uri (or any URI) refers to a Kafka event (not an object store key)."""
    return value is not None and value.startswith(SCHEME)


def parse(ref: str) -> tuple[str, int, int]:
    """kafka://TOPIC/PARTITION/OFFSET -> (topic, partition, offset); ValueError for anything else."""
    parts = ref[len(SCHEME):].split("/") if ref.startswith(SCHEME) else []
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"not a kafka://TOPIC/PARTITION/OFFSET reference: {ref!r}")
    return parts[0], int(parts[1]), int(parts[2])


def ranges(offsets: Iterable[int], max_gap: int = MAX_GAP) -> list[tuple[int, int]]:
    """Sorted offsets as (first, last) ranges, splitting where two are more than max_gap apart:
    reading the events in between is cheaper than a seek up to that gap."""
    out: list[tuple[int, int]] = []
    for o in sorted(set(offsets)):
        if out and o - out[-1][1] <= max_gap:
            out[-1] = (out[-1][0], o)
        else:
            out.append((o, o))
    return out


class EventMissing(LookupError):
    """A referenced event is no longer (or not yet) in its partition: retention passed, or a wrong reference."""


class EventFetcher:
    """Reads referenced events' raw values (a consumer outside any group: assigns, never commits)."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 30.0) -> None:
        self._consumer = Consumer(kafka.as_confluent(**{
            "group.id": "rollstream-event-fetch", "enable.auto.commit": False, "enable.partition.eof": True,
            "fetch.message.max.bytes": kafka.message_max_bytes, "fetch.wait.max.ms": 10}))
        self.timeout_s = timeout_s

    def fetch_many(self, refs: Iterable[str]) -> dict[str, bytes]:
        """The raw value of every referenced event, by reference. EventMissing when one is not there."""
        wanted: dict[tuple[str, int], set[int]] = defaultdict(set)
        for ref in refs:
            topic, partition, offset = parse(ref)
            wanted[(topic, partition)].add(offset)
        found: dict[str, bytes] = {}
        for (topic, partition), offsets in sorted(wanted.items()):
            for first, last in ranges(offsets):
                found.update(self._read_range(topic, partition, first, last, offsets))
        return found

    def fetch(self, ref: str) -> bytes:
        return self.fetch_many([ref])[ref]

    def _read_range(self, topic: str, partition: int, first: int, last: int, keep: set[int]) -> dict[str, bytes]:
        low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        if first < low or last >= high:
            raise EventMissing(f"{uri(topic, partition, first)} .. offset {last}: partition {partition} of "
                               f"{topic} holds offsets {low} .. {high - 1}")
        self._consumer.assign([TopicPartition(topic, partition, first)])
        out: dict[str, bytes] = {}
        want = {o for o in keep if first <= o <= last}
        deadline = time.monotonic() + self.timeout_s
        while want:
            if time.monotonic() > deadline:
                raise EventMissing(f"{len(want)} events of {topic}[{partition}] not read within {self.timeout_s:g} s "
                                   f"(first missing offset {min(want)})")
            for msg in self._consumer.consume(500, 1.0):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(msg.error())
                o = msg.offset()
                if o in want:
                    out[uri(topic, partition, o)] = msg.value()
                    want.discard(o)
                if o >= last:
                    break
            if want and all(o < (self._position(topic, partition) or 0) for o in want):
                # compacted away or a transaction marker stood there: the offset holds no event
                raise EventMissing(f"{topic}[{partition}] has no event at offsets {sorted(want)[:5]}")
        return out

    def _position(self, topic: str, partition: int) -> int | None:
        pos = self._consumer.position([TopicPartition(topic, partition)])[0].offset
        return pos if pos >= 0 else None

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> EventFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
