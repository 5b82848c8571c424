"""An EventFetcher asks consume() for no more events than the range it reads can still hold.

librdkafka's consume(n, timeout) returns once it has n messages or the timeout has passed: asked for 500 when a
range holds three, every range read waited out the whole timeout (half of a learner's step went there, found with
py-spy in `bench peer`). The consumer here keeps that contract over an in-memory partition; the real broker path
is covered by test_learner_process and the streams integration tests."""

from __future__ import annotations

import schemas.eventref as eventref
from schemas.settings import KafkaSettings

PARTITION_EVENTS = 40


class Message:
    def __init__(self, offset: int) -> None:
        self._offset = offset

    def error(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return f"event {self._offset}".encode()


class PartitionConsumer:
    """One partition holding offsets 0 .. PARTITION_EVENTS - 1; consume() returns early only with n messages."""

    made: list[PartitionConsumer] = []

    def __init__(self, config: dict) -> None:
        self.position_ = 0
        self.waited_s = 0.0
        self.asked: list[int] = []
        PartitionConsumer.made.append(self)

    def get_watermark_offsets(self, tp, timeout: float) -> tuple[int, int]:
        return 0, PARTITION_EVENTS

    def assign(self, tps) -> None:
        self.position_ = tps[0].offset

    def consume(self, n: int, timeout: float) -> list[Message]:
        self.asked.append(n)
        got = [Message(o) for o in range(self.position_, min(self.position_ + n, PARTITION_EVENTS))]
        self.position_ += len(got)
        if len(got) < n:
            self.waited_s += timeout
        return got

    def position(self, tps):
        return [type("TopicPartition", (), {"offset": self.position_})()]

    def unassign(self) -> None:
        pass

    def close(self) -> None:
        pass


def fetcher(monkeypatch) -> tuple[eventref.EventFetcher, PartitionConsumer]:
    PartitionConsumer.made = []
    monkeypatch.setattr(eventref, "Consumer", PartitionConsumer)
    made = eventref.EventFetcher(KafkaSettings())
    return made, PartitionConsumer.made[0]


def refs(*offsets: int) -> list[str]:
    return [eventref.uri("trajectories", 0, o) for o in offsets]


def test_a_short_range_in_the_middle_of_a_partition_is_read_without_waiting_out_the_timeout(monkeypatch):
    events, consumer = fetcher(monkeypatch)
    found = events.fetch_many(refs(5, 6, 8))
    assert found == {ref: f"event {o}".encode() for ref, o in zip(refs(5, 6, 8), (5, 6, 8), strict=True)}
    assert consumer.asked == [4] and consumer.waited_s == 0


def test_a_range_that_ends_the_partition_is_read_without_waiting_out_the_timeout(monkeypatch):
    events, consumer = fetcher(monkeypatch)
    assert len(events.fetch_many(refs(37, 38, 39))) == 3
    assert consumer.asked == [3] and consumer.waited_s == 0


def test_a_range_longer_than_one_consume_is_read_in_calls_of_at_most_the_batch_size(monkeypatch):
    monkeypatch.setattr(eventref, "CONSUME_BATCH", 16)
    events, consumer = fetcher(monkeypatch)
    wanted = list(range(0, PARTITION_EVENTS, 2))
    assert len(events.fetch_many(refs(*wanted))) == len(wanted)
    assert consumer.asked == [16, 16, 7] and consumer.waited_s == 0
