"""A reader of decoded events on some topics, from their end at creation on.

Benchmarks and tests watch what a component publishes (batches, metrics, groups, dead letters)
without joining any consumer group: the reader assigns itself every partition at its end offset,
keeps the events of one run (the dead letters whatever their run) and when each arrived.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from schemas import topics
from schemas.codec import UndecodableEvent, codec
from schemas.settings import KafkaSettings


class TopicReader:
    """Reads decoded events of some topics from their end at creation on, keeping a run's events."""

    def __init__(self, kafka: KafkaSettings, topic_names: Iterable[str], run: str | None = None) -> None:
        self.run = run
        self._consumer = Consumer(kafka.as_confluent(**{
            "group.id": f"reader-{uuid.uuid4().hex[:10]}", "enable.auto.commit": False,
            "fetch.message.max.bytes": kafka.message_max_bytes, "fetch.wait.max.ms": 5}))
        parts = []
        for name in topic_names:
            meta = self._consumer.list_topics(name, timeout=10).topics[name]
            for p in meta.partitions:
                end = self._consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1]
                parts.append(TopicPartition(name, p, end))
        self._consumer.assign(parts)
        self.events: dict[str, list[dict[str, Any]]] = {name: [] for name in topic_names}
        self.received_at: dict[str, list[float]] = {name: [] for name in topic_names}
        self.keys: dict[str, list[bytes | None]] = {name: [] for name in topic_names}

    def poll(self, timeout: float = 0.2) -> int:
        """Reads what has arrived (waiting up to `timeout`); returns how many events were kept."""
        kept = 0
        for msg in self._consumer.consume(500, timeout):
            if msg.error() is not None:
                continue
            name = msg.topic()
            try:
                value = codec().decode(msg.value(), topics.EVENT_OF_TOPIC[name])
            except UndecodableEvent:
                continue  # another producer's garbage; the streams app dead-letters it
            run = value.get("run", value.get("request", {}).get("run"))
            if self.run is not None and name != topics.DLQ and run != self.run:
                continue
            self.events[name].append(value)
            self.received_at[name].append(time.perf_counter())
            self.keys[name].append(msg.key())
            kept += 1
        return kept

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str | Callable[[], str] = "",
                 on_poll: Callable[[], object] | None = None, log: Callable[[], str] | None = None) -> None:
        """Polls until predicate() holds; AssertionError naming `what` (and log(), if given) on timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                detail = f"\n{log()}" if log is not None else ""
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what() if callable(what) else what}{detail}")
            self.poll()
            if on_poll is not None:
                on_poll()

    def pause(self) -> None:
        """Stops fetching until `resume` (what arrives meanwhile is read then): a reader left fetching
        while a benchmark measures costs the broker and this process a fetch every few milliseconds."""
        self._consumer.pause(self._consumer.assignment())

    def resume(self) -> None:
        self._consumer.resume(self._consumer.assignment())

    def close(self) -> None:
        self._consumer.close()
