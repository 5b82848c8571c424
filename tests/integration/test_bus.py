"""Events through the real broker: both client libraries, both directions, and the dead-letter path."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from schemas import samples, topics
from schemas.bus import EventConsumer, EventProducer
from schemas.codec import codec

pytestmark = pytest.mark.integration


def _kafka_python_consumer(infra, topic: str) -> KafkaConsumer:
    """A kafka-python consumer positioned at the current end of every partition of `topic`."""
    consumer = KafkaConsumer(**infra.kafka.as_kafka_python(enable_auto_commit=False, consumer_timeout_ms=1000,
                                                            fetch_max_bytes=32 * 1024 * 1024,
                                                            max_partition_fetch_bytes=16 * 1024 * 1024))
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    consumer.assign(parts)
    consumer.seek_to_end(*parts)
    for p in parts:  # resolve the positions now, before anything is produced
        consumer.position(p)
    return consumer


@pytest.mark.parametrize("topic", topics.ALL_TOPICS)
def test_event_produced_with_confluent_kafka_is_consumed_by_kafka_python(infra, topic):
    event_type = topics.EVENT_OF_TOPIC[topic]
    key = f"roundtrip-{uuid.uuid4().hex}"
    consumer = _kafka_python_consumer(infra, topic)
    with EventProducer(infra.kafka) as producer:
        producer.send(topic, samples.example(event_type), key=key)
    found = []
    deadline = time.monotonic() + 20
    while not found and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            found += [r for r in records if r.key == key.encode()]
    consumer.close()
    assert len(found) == 1
    assert codec().decode(found[0].value, event_type) == samples.example(event_type)


@pytest.mark.parametrize("topic", topics.ALL_TOPICS)
def test_event_produced_with_kafka_python_is_consumed_by_the_event_consumer(infra, topic):
    event_type = topics.EVENT_OF_TOPIC[topic]
    key = f"roundtrip-{uuid.uuid4().hex}"
    consumer = EventConsumer(infra.kafka, group_id=key, topic_names=[])
    consumer.assign({topic: consumer.end_offsets(topic)})
    producer = KafkaProducer(**infra.kafka.as_kafka_python(acks="all", max_request_size=16 * 1024 * 1024))
    producer.send(topic, key=key.encode(), value=codec().encode(event_type, samples.example(event_type))).get(timeout=20)
    producer.close()
    found = []
    deadline = time.monotonic() + 20
    while not found and time.monotonic() < deadline:
        event = consumer.poll(0.5)
        if event is not None and event.key == key.encode():
            found.append(event)
    consumer.close()
    assert len(found) == 1
    assert found[0].value == samples.example(event_type)
    assert found[0].topic == topic


def test_a_large_trajectory_event_fits_through_the_topic(infra):
    big = samples.trajectory(num_tokens=300_000)  # ~2.7 MB: far above Kafka's 1 MB default
    key = f"big-{uuid.uuid4().hex}"
    consumer = EventConsumer(infra.kafka, group_id=key, topic_names=[])
    consumer.assign({topics.TRAJECTORIES: consumer.end_offsets(topics.TRAJECTORIES)})
    with EventProducer(infra.kafka) as producer:
        producer.send(topics.TRAJECTORIES, big, key=key)
    event = None
    deadline = time.monotonic() + 20
    while event is None and time.monotonic() < deadline:
        e = consumer.poll(0.5)
        event = e if e is not None and e.key == key.encode() else None
    consumer.close()
    assert event is not None and event.value == big


def test_bytes_that_are_not_an_event_reach_the_dead_letter_topic_with_a_reason(infra):
    key = f"poison-{uuid.uuid4().hex}"
    poison = [b"\x00definitely not avro", codec().encode("metric", samples.metric()), None]
    good = samples.trajectory()
    consumer = EventConsumer(infra.kafka, group_id=key, topic_names=[])
    consumer.assign({topics.TRAJECTORIES: consumer.end_offsets(topics.TRAJECTORIES)})
    dlq_reader = EventConsumer(infra.kafka, group_id=f"{key}-dlq", topic_names=[])
    dlq_reader.assign({topics.DLQ: dlq_reader.end_offsets(topics.DLQ)})
    with EventProducer(infra.kafka) as producer:
        for data in poison:
            producer.send_raw(topics.TRAJECTORIES, data, key=key)
        producer.send(topics.TRAJECTORIES, good, key=key)

    received = []
    deadline = time.monotonic() + 20
    while not received and time.monotonic() < deadline:
        e = consumer.poll(0.5)
        if e is not None and e.key == key.encode():
            received.append(e)
    assert [e.value for e in received] == [good]  # the good event arrives after the three bad ones
    assert consumer.dead_lettered == 3
    consumer.commit()
    consumer.close()

    letters = []
    deadline = time.monotonic() + 20
    while len(letters) < 3 and time.monotonic() < deadline:
        e = dlq_reader.poll(0.5)
        if e is not None and e.key == key.encode():
            letters.append(e.value)
    dlq_reader.close()
    assert [letter["value"] for letter in letters] == poison  # original bytes kept whole, in order
    assert all(letter["source_topic"] == topics.TRAJECTORIES for letter in letters)
    assert all(letter["consumer"] == key for letter in letters)
    reasons = [letter["reason"] for letter in letters]
    assert "not an Avro single-object encoding" in reasons[0]
    assert "expected a trajectory event, got a metric event" in reasons[1]
    assert "empty value" in reasons[2]
    assert [letter["source_offset"] for letter in letters] == sorted(letter["source_offset"] for letter in letters)
