"""Typed produce and consume helpers around the codec (confluent-kafka).

Producers encode by topic (each topic carries one event type, schemas/topics.py) and are
idempotent with acks=all, so a retry never duplicates an event inside Kafka. Consumers decode
every message; whatever cannot be decoded goes to the dead-letter topic with the reason and the
original bytes, and only then is its offset allowed to be committed: nothing is silently dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas import topics
from schemas.codec import InvalidEvent, UndecodableEvent, codec
from schemas.eventref import backoff_s, retrying, transient_error
from schemas.settings import KafkaSettings

log = logging.getLogger("rollstream.bus")


class DeliveryError(RuntimeError):
    """The broker did not acknowledge every event in time, or refused one."""


def now_ms() -> int:
    return int(time.time() * 1000)


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


def topic_partitions(admin: AdminClient, names: Iterable[str], wait_s: float = 10.0) -> dict[str, int]:
    """{name: partition count} of the named topics, 0 for one that does not exist. A topic created
    a moment ago may not be in the answering broker's metadata yet (KRaft spreads it after the
    create call returns: seen in CI as "do not exist" right after create_topics), so a missing one
    is asked for again until wait_s has passed."""
    names = list(names)
    deadline = time.monotonic() + wait_s
    while True:
        existing = admin.list_topics(timeout=10).topics
        counts = {name: len(existing[name].partitions) if name in existing else 0 for name in names}
        if all(counts.values()) or time.monotonic() >= deadline:
            return counts
        time.sleep(0.2)


def create_missing_topics(admin: AdminClient, new_topics: Iterable[NewTopic]) -> list[str]:
    """Creates these topics, leaving any that another client created first as it is, and returns
    the names created once they are in the metadata (topic_partitions), so that whoever subscribes
    or produces next finds them."""
    new_topics = list(new_topics)
    if not new_topics:
        return []
    created = []
    for name, future in admin.create_topics(new_topics).items():
        try:
            future.result()
            created.append(name)
        except Exception as error:  # noqa: BLE001 - only an existing topic is expected
            if "TOPIC_ALREADY_EXISTS" not in str(error):
                raise
    topic_partitions(admin, created)
    return created


class EventProducer:
    """Sends events to their topics. Call `flush()` before treating work as durable."""

    def __init__(self, kafka: KafkaSettings, client_id: str = "rollstream", **overrides: Any) -> None:
        conf = kafka.as_confluent(**{
            "client.id": client_id,
            "acks": "all",
            "enable.idempotence": True,
            "compression.type": kafka.compression,
            "message.max.bytes": kafka.message_max_bytes,
            "linger.ms": 5,
            **overrides,
        })
        self._producer = Producer(conf)
        self._errors: list[str] = []

    def send(self, topic: str, value: dict[str, Any], key: str | bytes | None = None,
             on_delivery: Callable[[KafkaError | None, Message], None] | None = None) -> None:
        """Encodes `value` as the topic's event type and queues it. Raises InvalidEvent for a
        value that does not match the schema (nothing is sent then)."""
        if topic not in topics.EVENT_OF_TOPIC:
            raise KeyError(f"unknown topic {topic!r}")
        data = codec().encode(topics.EVENT_OF_TOPIC[topic], value)
        self.send_raw(topic, data, key, on_delivery)

    def send_raw(self, topic: str, data: bytes | None, key: str | bytes | None = None,
                 on_delivery: Callable[[KafkaError | None, Message], None] | None = None, *,
                 partition: int | None = None) -> None:
        """Queues bytes as they are (for the dead-letter topic, forwarded events and tests of bad
        input), into `partition` when given, else where the key's hash puts them."""
        where = {} if partition is None else {"partition": partition}

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self._errors.append(f"{msg.topic()}: {err}")
            if on_delivery is not None:
                on_delivery(err, msg)

        while True:
            try:
                self._producer.produce(topic, value=data, key=_key_bytes(key), on_delivery=delivered, **where)
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)
        self._producer.poll(0)

    def flush(self, timeout: float = 120.0) -> None:
        """Blocks until every queued event is acknowledged; raises DeliveryError otherwise. The default
        outlasts a broker restart (about 30 s here, then leaders are re-elected)."""
        remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryError(f"{remaining} events not acknowledged within {timeout} s")
        if self._errors:
            errors, self._errors = self._errors, []
            raise DeliveryError("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))

    def poll(self, timeout: float = 0.0) -> None:
        self._producer.poll(timeout)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ConsumedEvent:
    """One decoded event with where it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: dict[str, Any]
    timestamp_ms: int


def dead_letter(*, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                error: Exception, consumer: str) -> dict[str, Any]:
    """The dead_letter event for a message that failed with `error`."""
    reason = error.reason if isinstance(error, UndecodableEvent) else str(error)
    return {
        "source_topic": topic, "source_partition": partition, "source_offset": offset,
        "key": key, "value": value, "reason": reason, "error_type": type(error).__name__,
        "consumer": consumer, "failed_at_ms": now_ms(),
    }


# Commit errors a broker restart or a coordinator move causes: the commit goes through once the
# group's coordinator is found again.
TRANSIENT_COMMIT_ERRORS = frozenset({
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._WAIT_COORD,
    KafkaError.NETWORK_EXCEPTION,
})


def commit_retrying(consumer: Consumer, offsets: list[TopicPartition] | None = None, timeout_s: float = 120.0) -> None:
    """A synchronous commit that rides out a broker restart: transient coordinator errors are retried
    for up to timeout_s; any other error (a rebalance took the partitions: ILLEGAL_GENERATION,
    UNKNOWN_MEMBER_ID) is raised at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if offsets is None:
                consumer.commit(asynchronous=False)
            else:
                consumer.commit(offsets=offsets, asynchronous=False)
            return
        except KafkaException as e:
            error = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
            transient = error is not None and (error.code() in TRANSIENT_COMMIT_ERRORS or error.retriable())
            if not transient or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class EventConsumer:
    """Consumes topics in one consumer group and yields decoded events.

    Offsets are committed only by `commit()`, after the caller has made its work durable. A
    message that does not decode is sent to the dead-letter topic (and flushed) before `poll`
    moves past it, so committing past it loses nothing.
    """

    def __init__(self, kafka: KafkaSettings, group_id: str, topic_names: Iterable[str], *,
                 client_id: str = "rollstream", dlq: EventProducer | None = None,
                 auto_offset_reset: str = "earliest", **overrides: Any) -> None:
        self.group_id = group_id
        self._consumer = Consumer(kafka.as_confluent(**{
            "group.id": group_id,
            "client.id": client_id,
            "enable.auto.commit": False,
            "auto.offset.reset": auto_offset_reset,
            "partition.assignment.strategy": "cooperative-sticky",
            "fetch.message.max.bytes": kafka.message_max_bytes,
            **overrides,
        }))
        self._dlq = dlq if dlq is not None else EventProducer(kafka, client_id=f"{client_id}-dlq")
        names = list(topic_names)
        if names:
            self._consumer.subscribe(names)
        self.dead_lettered = 0

    def end_offsets(self, topic: str) -> dict[int, int]:
        """High watermark (the offset the next event will get) of every partition of `topic`."""
        meta = retrying(lambda: self._consumer.list_topics(topic, timeout=10), f"listing {topic}")
        return {p: retrying(lambda p=p: self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10),
                            f"reading the end of {topic}[{p}]")[1]
                for p in meta.topics[topic].partitions}

    def committed(self, topic: str) -> dict[int, int]:
        """The group's committed offset of every partition of `topic` that has one."""
        parts = [TopicPartition(topic, p) for p in self.end_offsets(topic)]
        # NOT_COORDINATOR while a new group's coordinator is chosen, or a broker restarting: retried.
        committed = retrying(lambda: self._consumer.committed(parts, timeout=10), f"reading {self.group_id}'s offsets")
        return {tp.partition: tp.offset for tp in committed if tp.offset >= 0}

    def assign(self, offsets: dict[str, dict[int, int]]) -> None:
        """Reads exactly these partitions from these offsets ({topic: {partition: offset}}),
        outside group management (for replays and checks, not for workers)."""
        self._consumer.assign([TopicPartition(t, p, o) for t, parts in offsets.items() for p, o in parts.items()])

    def poll(self, timeout: float = 1.0) -> ConsumedEvent | None:
        """The next decodable event, or None when none arrived within `timeout`. Transient errors
        (a broker restarting: schemas/eventref.py's rule) are ridden through, since the client
        reconnects by itself; any other error raises KafkaException."""
        deadline = time.monotonic() + timeout
        transient = 0
        while True:
            msg = self._consumer.poll(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if msg.error() is not None:
                error = msg.error()
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                if not transient_error(error):
                    raise KafkaException(error)
                # Backed off as eventref's retries are, within this poll's timeout: librdkafka reports
                # such an error once per broker state change, but a burst must not spin.
                log.warning("%s: Kafka error ridden through: %s", self.group_id, error)
                time.sleep(min(backoff_s(transient), max(0.0, deadline - time.monotonic())))
                transient += 1
                continue
            event = self._decode(msg)
            if event is not None:
                return event
            if time.monotonic() >= deadline:
                return None

    def _decode(self, msg: Message) -> ConsumedEvent | None:
        topic = msg.topic()
        try:
            event_type = topics.EVENT_OF_TOPIC[topic]
            value = codec().decode(msg.value(), event_type)
        except (UndecodableEvent, KeyError, InvalidEvent) as e:
            self._dlq.send(topics.DLQ, dead_letter(
                topic=topic, partition=msg.partition(), offset=msg.offset(), key=msg.key(),
                value=msg.value(), error=e, consumer=self.group_id), key=msg.key())
            self._dlq.flush()  # durable in dlq before we can move past it
            self.dead_lettered += 1
            return None
        return ConsumedEvent(topic, msg.partition(), msg.offset(), msg.key(), value, msg.timestamp()[1])

    def commit(self, events: Iterable[ConsumedEvent] | None = None, timeout_s: float = 120.0) -> None:
        """Commits (synchronously) past the given events, or past everything polled so far; transient
        errors are retried for up to timeout_s (commit_retrying)."""
        if events is None:
            commit_retrying(self._consumer, timeout_s=timeout_s)
            return
        latest: dict[tuple[str, int], int] = {}
        for e in events:
            latest[(e.topic, e.partition)] = max(latest.get((e.topic, e.partition), -1), e.offset)
        if latest:
            commit_retrying(self._consumer, [TopicPartition(t, p, o + 1) for (t, p), o in latest.items()], timeout_s)

    def close(self) -> None:
        self._consumer.close()
        self._dlq.flush()

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
