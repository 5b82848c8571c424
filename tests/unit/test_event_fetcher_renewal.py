"""An EventFetcher whose consumer keeps answering _UNKNOWN_PARTITION after a broker restart replaces
it instead of retrying the same stale client until it gives up. Found by `bench chaos`: 300 s of
"Failed to get watermark offsets: Local: Unknown partition" after a restart, then the learner exited.
The consumer here is a stand-in that behaves as the stale one did; the real broker path is covered by
the chaos and faults integration tests."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

import schemas.eventref as eventref
from schemas.settings import KafkaSettings


class Message:
    def __init__(self, offset: int, value: bytes) -> None:
        self._offset, self._value = offset, value

    def error(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value


class StaleThenFreshConsumer:
    """The first consumer made never finds the partition again; any later one reads it."""

    made: list[StaleThenFreshConsumer] = []

    def __init__(self, config: dict) -> None:
        self.stale = not StaleThenFreshConsumer.made
        self.closed = False
        StaleThenFreshConsumer.made.append(self)

    def get_watermark_offsets(self, tp, timeout: float):
        if self.stale:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, "Failed to get watermark offsets"))
        return 0, 10

    def assign(self, tps) -> None:
        self.first = tps[0].offset

    def consume(self, n: int, timeout: float):
        return [Message(self.first, b"event")]

    def unassign(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_consumer_stuck_on_an_unknown_partition_is_replaced_and_the_read_goes_through(monkeypatch):
    StaleThenFreshConsumer.made = []
    monkeypatch.setattr(eventref, "Consumer", StaleThenFreshConsumer)
    monkeypatch.setattr(eventref.time, "sleep", lambda s: None)
    fetcher = eventref.EventFetcher(KafkaSettings(), outage_s=300)
    ref = eventref.uri("trajectories", 0, 7)
    assert fetcher.fetch(ref) == b"event"
    first, second = StaleThenFreshConsumer.made
    assert first.closed and not second.closed
    assert fetcher._retries == eventref.RENEW_EVERY
