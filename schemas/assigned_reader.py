"""A reader of whole topics outside any consumer group (assign() mode) that notices when it stops reading.

Why: after a broker restart an assign()-mode consumer can keep metadata without a partition and read
nothing of it for as long as it lives, with no error to say so (bench chaos 2026-12-04: the dispatcher's
progress reader saw no trained batch after a restart, held its in-flight bound full and the run stood
still for 24 minutes; a fresh consumer read everything at once). A consumer group would rebalance; a
reader that assigns its partitions itself has to check.

The rule (`lagging`, `stuck_partitions`, pure): every `check_s` the reader compares where it has read to
with each partition's end. A partition that had events past what was read at one check and was not read
any further by the next is stuck; so is a check the broker cannot answer. Either renews the consumer,
from where the old one had read to. Events read twice cannot happen (the new consumer starts at the old
one's positions); events are not skipped (a position is only ever where the old consumer stopped).

`AssignedReader` is the I/O around it: the dispatcher's progress reader and `up`'s run view use it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from schemas.eventref import close_consumer
from schemas.settings import KafkaSettings

log = logging.getLogger("rollstream.assigned_reader")

Partition = tuple[str, int]
STUCK_CHECK_S = 30.0
"""How often a reader checks that it still reads what its partitions hold."""


def lagging(read_to: Mapping[Partition, int], ends: Mapping[Partition, int]) -> dict[Partition, int]:
    """{partition: offset read to} of the partitions with events past what was read (`read_to` holds
    every partition followed: where reading started, until something was read)."""
    return {tp: read_to[tp] for tp, end in ends.items() if tp in read_to and end > read_to[tp]}


def stuck_partitions(lagging_before: Mapping[Partition, int], read_to: Mapping[Partition, int],
                     ends: Mapping[Partition, int]) -> set[Partition]:
    """Partitions a reader has not moved on since the last check although they had, and still have,
    events past what it read: `lagging_before` is the last check's {partition: offset read to} of the
    lagging ones, `read_to` the offsets read to now, `ends` the high watermarks now."""
    return {tp for tp, before in lagging_before.items() if read_to.get(tp) == before and ends.get(tp, 0) > before}


class AssignedReader:
    """Every partition of `names`, from each one's beginning (or from the first event at or after
    `since_ms`, or its end when there is none), renewed when it stops reading (see the module)."""

    def __init__(self, kafka: KafkaSettings, names: Sequence[str], what: str, *, config: Mapping[str, Any],
                 since_ms: int | None = None, check_s: float = STUCK_CHECK_S) -> None:
        self.what, self.renewals = what, 0
        self._kafka, self._names, self._config, self._check_s = kafka, tuple(names), dict(config), check_s
        self._consumer, self._read_to = self._open(since_ms=since_ms)
        self._lagging: dict[Partition, int] = {}
        self._checked = time.monotonic()
        self._asked: str | None = None  # a renewal asked for from another thread (ask_renewal)

    def _open(self, *, since_ms: int | None = None, start: Mapping[Partition, int] | None = None,
              ) -> tuple[Consumer, dict[Partition, int]]:
        consumer = Consumer(self._kafka.as_confluent(**self._config))
        try:
            parts = [(name, p) for name in self._names
                     for p in consumer.list_topics(name, timeout=10).topics[name].partitions]
            at = dict(start or {})
            if since_ms is not None:
                found = consumer.offsets_for_times([TopicPartition(t, p, since_ms) for t, p in parts], timeout=10)
                at = {(tp.topic, tp.partition): tp.offset for tp in found}
            read_to = {}
            for tp in parts:
                low, high = consumer.get_watermark_offsets(TopicPartition(*tp), timeout=10)
                offset = at.get(tp, low)
                read_to[tp] = high if offset < 0 else max(low, offset)  # -1: nothing at or after since_ms
            consumer.assign([TopicPartition(t, p, offset) for (t, p), offset in read_to.items()])
        except KafkaException:
            consumer.close()
            raise
        return consumer, read_to

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        """What the consumer hands out, then the check when one is due (or the renewal asked for)."""
        messages = self._consumer.consume(num_messages, timeout)
        asked, self._asked = self._asked, None
        if asked is not None:
            self.renew(asked)
        elif time.monotonic() - self._checked >= self._check_s:
            self.check()
        return messages

    def ask_renewal(self, why: str) -> None:
        """Renews the consumer at the next consume, on the thread that consumes: a librdkafka consumer
        is not to be called from a second thread while it consumes (its position() then waits for ever)."""
        self._asked = why

    def check(self) -> None:
        """Renews the consumer when a partition is stuck or the broker does not answer."""
        self._checked = time.monotonic()
        try:
            self._note_positions()
            ends = {tp: self._consumer.get_watermark_offsets(TopicPartition(*tp), timeout=10, cached=False)[1]
                    for tp in self._read_to}
        except KafkaException as error:
            self.renew(f"its broker did not answer ({error})")
            return
        stuck = stuck_partitions(self._lagging, self._read_to, ends)
        self._lagging = lagging(self._read_to, ends)
        if stuck:
            self.renew(f"{', '.join(f'{t}[{p}]' for t, p in sorted(stuck))} had events past "
                       f"what it read and were not read any further in {self._check_s:g} s")

    def _note_positions(self) -> None:
        """Where the consumer has read to, per partition (its position also steps over transaction
        markers, which no message's offset shows); a partition not fetched yet keeps where reading began."""
        for tp in self._consumer.position([TopicPartition(*tp) for tp in self._read_to]):
            if tp.offset >= 0:
                self._read_to[(tp.topic, tp.partition)] = tp.offset

    def renew(self, why: str = "asked to") -> None:
        """A new consumer in place of the old one, from where the old one had read to (on the thread that
        consumes). While the broker is still away nothing changes and the next check tries again."""
        try:
            self._note_positions()
            fresh, read_to = self._open(start=self._read_to)
        except KafkaException as error:
            log.warning("%s could not be renewed (%s): %s", self.what, why, error)
            return
        old, self._consumer, self._read_to, self._lagging = self._consumer, fresh, read_to, {}
        self.renewals += 1
        log.warning("%s renewed: %s", self.what, why)
        close_consumer(old, f"the old consumer of {self.what}")

    def close(self) -> None:
        self._consumer.close()
