"""The rule that renews an assign()-mode reader after a broker restart left it reading nothing, and the
reader acting on it. The reader's Kafka consumer is a stub here (tests/integration/test_dispatcher.py
renews a real one)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from schemas.assigned_reader import AssignedReader, lagging, stuck_partitions

A, B, C = ("batches", 0), ("weights", 0), ("metrics", 3)


def test_a_partition_lagging_at_two_checks_without_moving_is_stuck():
    ends = {A: 10, B: 5, C: 7}
    before = lagging({A: 4, B: 5, C: 2}, ends)
    assert before == {A: 4, C: 2}  # B is read to its end
    # A did not move although events wait; C moved on; B is still at its end
    assert stuck_partitions(before, {A: 4, B: 5, C: 6}, ends) == {A}
    # events written to B since are no reason: it was not lagging at the last check
    assert stuck_partitions(before, {A: 10, B: 5, C: 7}, {A: 10, B: 9, C: 7}) == set()


def test_a_partition_not_followed_is_never_lagging_or_stuck():
    assert lagging({}, {A: 3}) == {}
    assert stuck_partitions({A: 1}, {}, {A: 3}) == set()


class _Consumer:
    """Reads nothing: its positions stay where they are while the partitions' ends grow."""

    def __init__(self, positions: dict, ends: dict, answers: bool = True) -> None:
        self.positions, self.ends, self.answers, self.closed = positions, ends, answers, False

    def consume(self, num_messages: int, timeout: float) -> list:
        return []

    def position(self, parts: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), -1001))
                for tp in parts]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        if not self.answers:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        return 0, self.ends[(tp.topic, tp.partition)]

    def close(self) -> None:
        self.closed = True


def _reader(consumer: _Consumer, read_to: dict, opened: list, broker_back: bool = True) -> AssignedReader:
    reader = AssignedReader.__new__(AssignedReader)  # no Kafka client: the stubs stand in for it
    reader.what, reader.renewals, reader._check_s, reader._checked, reader._lagging = "the test reader", 0, 30.0, 0.0, {}
    reader._consumer, reader._read_to, reader._asked = consumer, dict(read_to), None

    def _open(*, since_ms=None, start=None):
        if not broker_back:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        opened.append(dict(start))
        return _Consumer(dict(start), consumer.ends), dict(start)

    reader._open = _open
    return reader


def test_a_reader_that_reads_nothing_while_events_wait_is_renewed_from_where_it_stopped():
    old, opened = _Consumer({A: 4, B: 5}, {A: 10, B: 5}), []
    reader = _reader(old, {A: 0, B: 0}, opened)
    reader.check()  # A lags: noted, not yet stuck
    assert reader.renewals == 0 and opened == []
    reader.check()  # A has not moved since: stuck
    assert reader.renewals == 1 and opened == [{A: 4, B: 5}] and old.closed
    reader.check()  # the fresh consumer's first check starts the count again
    assert reader.renewals == 1


def test_a_reader_that_moves_on_is_left_alone():
    consumer, opened = _Consumer({A: 4}, {A: 10}), []
    reader = _reader(consumer, {A: 0}, opened)
    reader.check()
    consumer.positions[A] = 6
    reader.check()
    consumer.positions[A] = 10
    reader.check()
    assert reader.renewals == 0 and opened == []


def test_a_broker_that_does_not_answer_renews_and_a_renewal_that_fails_keeps_the_old_consumer():
    old, opened = _Consumer({A: 4}, {A: 10}, answers=False), []
    reader = _reader(old, {A: 0}, opened, broker_back=False)
    reader.check()
    assert reader.renewals == 0 and reader._consumer is old and not old.closed  # tried again at the next check
    reader._open = _reader(old, {A: 0}, opened)._open  # the broker is back
    reader.check()
    assert reader.renewals == 1 and opened == [{A: 4}] and old.closed


def test_a_renewal_asked_for_from_another_thread_happens_at_the_next_consume():
    old, opened = _Consumer({A: 4}, {A: 4}), []
    reader = _reader(old, {A: 0}, opened)
    reader.ask_renewal("asked")
    assert reader.renewals == 0 and not old.closed  # nothing happens on the asking thread
    reader.consume(10, 0)
    assert reader.renewals == 1 and opened == [{A: 4}] and old.closed
    reader.consume(10, 0)
    assert reader.renewals == 1
