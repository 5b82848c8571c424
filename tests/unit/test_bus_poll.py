"""EventConsumer.poll rides through the transient errors a broker restart reports (schemas/eventref.py's
rule) and raises on the others. The confluent-kafka consumer is replaced by a stub that hands out
prepared messages; the errors are real KafkaError values."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from schemas import topics
from schemas.bus import EventConsumer
from schemas.codec import codec
from schemas.eventref import transient_error
from schemas.samples import example


class _Message:
    def __init__(self, error: KafkaError) -> None:
        self._error = error

    def error(self) -> KafkaError:
        return self._error


class _StubConsumer:
    """Returns the prepared messages in order, then None (nothing arrived)."""

    def __init__(self, messages: list[_Message]) -> None:
        self.messages = list(messages)

    def poll(self, timeout: float) -> _Message | None:
        return self.messages.pop(0) if self.messages else None


def consumer_over(messages: list[_Message]) -> EventConsumer:
    consumer = EventConsumer.__new__(EventConsumer)  # no Kafka client: the stub stands in for it
    consumer.group_id, consumer._consumer, consumer.dead_lettered = "test-group", _StubConsumer(messages), 0
    return consumer


@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError.LEADER_NOT_AVAILABLE,
                                  KafkaError.NOT_COORDINATOR, KafkaError._UNKNOWN_PARTITION])
def test_errors_of_a_restarting_broker_are_transient(code):
    assert transient_error(KafkaError(code))


@pytest.mark.parametrize("error", [KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED),
                                   KafkaError(KafkaError._TRANSPORT, fatal=True),
                                   KafkaError(KafkaError.UNSUPPORTED_VERSION)],
                         ids=["authorization", "fatal-transport", "unsupported-version"])
def test_fatal_and_permanent_errors_are_not_transient(error):
    assert not transient_error(error)


def test_poll_rides_through_transient_errors_and_returns_none_when_nothing_arrives():
    consumer = consumer_over([_Message(KafkaError(KafkaError._TRANSPORT)),
                              _Message(KafkaError(KafkaError._ALL_BROKERS_DOWN)),
                              _Message(KafkaError(KafkaError._PARTITION_EOF, retriable=False))])
    assert consumer.poll(0.05) is None
    assert consumer._consumer.messages == []


def test_poll_raises_on_a_fatal_error_even_after_transient_ones():
    consumer = consumer_over([_Message(KafkaError(KafkaError._TRANSPORT)),
                              _Message(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))])
    with pytest.raises(KafkaException) as raised:
        consumer.poll(5.0)
    assert raised.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_poll_still_decodes_the_event_that_follows_a_transient_error():
    topic = topics.WEIGHTS
    data = codec().encode(topics.EVENT_OF_TOPIC[topic], example(topics.EVENT_OF_TOPIC[topic]))

    class _Event(_Message):
        def __init__(self) -> None:
            super().__init__(None)  # type: ignore[arg-type]

        def topic(self) -> str:
            return topic

        def partition(self) -> int:
            return 0

        def offset(self) -> int:
            return 41

        def key(self) -> bytes:
            return b"run"

        def value(self) -> bytes:
            return data

        def timestamp(self) -> tuple[int, int]:
            return (1, 1_700_000_000_000)

    consumer = consumer_over([_Message(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)), _Event()])
    consumed = consumer.poll(5.0)
    assert consumed is not None and (consumed.topic, consumed.offset) == (topic, 41)
