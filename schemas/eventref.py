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

A broker restart is ridden through, not reported as a missing event: while the broker is down or
its partitions have no leader yet, the client's calls fail with transient errors (transport, timed
out, unknown partition, leader not available). `should_retry` decides which errors those are and
`backoff_s` how long to wait before the next try; the fetcher retries a range until `outage_s`
has passed since the first failure, then raises BrokerUnavailable. EventMissing is only for an
event the broker, when it answers, says it does not hold.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas.settings import KafkaSettings

log = logging.getLogger("rollstream.eventref")


def close_consumer(consumer: Consumer, what: str) -> None:
    """Closes a consumer that is being replaced; a consumer whose broker is gone may not close cleanly,
    which is logged, not raised."""
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as error:
        log.warning("closing %s: %s", what, error)


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


CONSUME_BATCH = 500
"""The most events one consume() call of EventFetcher asks for."""


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


class BrokerUnavailable(RuntimeError):
    """Kafka kept failing with transient errors for longer than the outage a client rides through."""


# What a broker restart looks like from a client: librdkafka marks few of these retriable (its flag
# is set only on errors it raised itself, and not on _UNKNOWN_PARTITION or _ALL_BROKERS_DOWN), so
# they are listed. An unknown topic or partition is among them: right after a restart the broker
# answers metadata before it has loaded its logs.
TRANSIENT_ERRORS = frozenset({
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC, KafkaError._RESOLVE, KafkaError._WAIT_COORD, KafkaError._WAIT_CACHE,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION, KafkaError.BROKER_NOT_AVAILABLE, KafkaError.REPLICA_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.KAFKA_STORAGE_ERROR,
})
OUTAGE_S = 300.0
"""How long a client rides through a broker that keeps failing transiently (a restart of the
single broker, stop and start, takes well under this on a loaded machine)."""
RENEW_EVERY = 4
"""An EventFetcher replaces its consumer every this many retries of a failing read (the first after
about 4 s of failures with backoff_s)."""


def should_retry(code: int, *, retriable: bool = False, fatal: bool = False) -> bool:
    """Whether a Kafka error is worth retrying: a transient one (listed, or flagged retriable by
    librdkafka), never a fatal one."""
    return not fatal and (retriable or code in TRANSIENT_ERRORS)


def backoff_s(attempt: int, first_s: float = 0.25, factor: float = 2.0, cap_s: float = 5.0) -> float:
    """The wait before retry number `attempt` (0 first): doubling from first_s up to cap_s, so a short
    blip costs a fraction of a second and a restart is polled every few seconds."""
    return min(cap_s, first_s * factor ** max(0, attempt))


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError a confluent-kafka exception carries, if any."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error if isinstance(error, KafkaError) else None


def transient_error(error: KafkaError) -> bool:
    """Whether a KafkaError is one `should_retry` accepts (also what a consumer's poll rides through, schemas/bus.py)."""
    return should_retry(error.code(), retriable=error.retriable(), fatal=error.fatal())


def is_transient(exc: BaseException) -> bool:
    """Whether an exception is a Kafka error `should_retry` accepts."""
    error = kafka_error(exc)
    return error is not None and transient_error(error)


T = TypeVar("T")


def retrying(call: Callable[[], T], what: str, outage_s: float = OUTAGE_S, *,
             on_retry: Callable[[KafkaException, float], None] | None = None,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """call() retried with backoff while it raises transient Kafka errors, for up to outage_s since
    the first one; then BrokerUnavailable naming `what` and the last error. Other errors pass."""
    first_failure: float | None = None
    attempt = 0
    while True:
        try:
            return call()
        except KafkaException as e:
            if not is_transient(e):
                raise
            now = clock()
            first_failure = now if first_failure is None else first_failure
            if now - first_failure >= outage_s:
                raise BrokerUnavailable(f"{what}: Kafka failed transiently for {now - first_failure:.0f} s "
                                        f"(last: {e}); giving up after {outage_s:g} s") from e
            wait = backoff_s(attempt)
            if on_retry is not None:
                on_retry(e, wait)
            sleep(wait)
            attempt += 1


def _log_retry(error: KafkaException, wait_s: float) -> None:
    log.warning("Kafka unavailable while fetching events (%s): retrying in %.1f s", error, wait_s)


class EventFetcher:
    """Reads referenced events' raw values (a consumer outside any group: assigns, never commits)."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 30.0, outage_s: float = OUTAGE_S) -> None:
        self._config = kafka.as_confluent(**{
            "group.id": "rollstream-event-fetch", "enable.auto.commit": False, "enable.partition.eof": True,
            "fetch.message.max.bytes": kafka.message_max_bytes, "fetch.wait.max.ms": 10})
        self._consumer = Consumer(self._config)
        self._retries = 0
        self.timeout_s = timeout_s
        """How long the events of one range, once the broker answers, may take to arrive."""
        self.outage_s = outage_s
        """How long transient broker errors are retried before BrokerUnavailable."""

    def fetch_many(self, refs: Iterable[str]) -> dict[str, bytes]:
        """The raw value of every referenced event, by reference. EventMissing when one is not there."""
        wanted: dict[tuple[str, int], set[int]] = defaultdict(set)
        for ref in refs:
            topic, partition, offset = parse(ref)
            wanted[(topic, partition)].add(offset)
        found: dict[str, bytes] = {}
        for (topic, partition), offsets in sorted(wanted.items()):
            for first, last in ranges(offsets):
                # A range read again from its start after a transient error: assign, read, nothing kept.
                read = functools.partial(self._read_range, topic, partition, first, last, offsets)
                found.update(retrying(read, f"reading {uri(topic, partition, first)} .. offset {last}", self.outage_s,
                                      on_retry=self._on_retry))
        return found

    def fetch(self, ref: str) -> bytes:
        return self.fetch_many([ref])[ref]

    def _read_range(self, topic: str, partition: int, first: int, last: int, keep: set[int]) -> dict[str, bytes]:
        low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        if first < low or last >= high:
            raise EventMissing(f"{uri(topic, partition, first)} .. offset {last}: partition {partition} of "
                               f"{topic} holds offsets {low} .. {high - 1}")
        self._consumer.assign([TopicPartition(topic, partition, first)])
        try:
            return self._read_assigned(topic, partition, first, last, keep)
        finally:
            # Idle, an assigned consumer would keep asking the broker for more every fetch.wait.max.ms.
            with contextlib.suppress(KafkaException):
                self._consumer.unassign()

    def _read_assigned(self, topic: str, partition: int, first: int, last: int, keep: set[int]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        want = {o for o in keep if first <= o <= last}
        deadline = time.monotonic() + self.timeout_s
        next_offset = first
        while want:
            if time.monotonic() > deadline:
                # The watermarks said the partition holds them: slow or absent brokers, not missing events.
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{len(want)} events of {topic}[{partition}] "
                                                f"not read within {self.timeout_s:g} s (first {min(want)})"))
            # consume() returns once it has that many messages or its timeout passed: asked for more than the
            # range still holds, it waited out the whole second on every range (half a learner's step was spent so).
            for msg in self._consumer.consume(max(1, min(CONSUME_BATCH, last - next_offset + 1)), 1.0):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(msg.error())
                o = msg.offset()
                next_offset = max(next_offset, o + 1)
                if o in want:
                    out[uri(topic, partition, o)] = msg.value()
                    want.discard(o)
                if o >= last:
                    break
            if want and all(o < (self._position(topic, partition) or 0) for o in want):
                # compacted away or a transaction marker stood there: the offset holds no event
                raise EventMissing(f"{topic}[{partition}] has no event at offsets {sorted(want)[:5]}")
        return out

    def _on_retry(self, error: KafkaException, wait_s: float) -> None:
        _log_retry(error, wait_s)
        self._retries += 1
        if self._retries % RENEW_EVERY == 0:
            self._renew()

    def _renew(self) -> None:
        """A new consumer in place of the old one. After a broker restart an assign()-mode consumer can
        keep metadata in which the partition does not exist and answer _UNKNOWN_PARTITION for as long as
        it lives (bench chaos: 300 s of it, then the learner exited); a new one asks the broker afresh."""
        old, self._consumer = self._consumer, Consumer(self._config)
        close_consumer(old, "the old event-fetch consumer")

    def _position(self, topic: str, partition: int) -> int | None:
        pos = self._consumer.position([TopicPartition(topic, partition)])[0].offset
        return pos if pos >= 0 else None

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> EventFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
