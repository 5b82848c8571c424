"""A new streams app's internal topics exist before its worker subscribes: on a fresh broker the
worker otherwise subscribed first, ignored the missing topics and only saw them at its next metadata
refresh (a run's first tasks waited 10 minutes in CI)."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from helpers.events import weights

from schemas import topics
from schemas.bus import EventProducer
from schemas.codec import codec
from streams.app import create_app, create_wiring
from streams.settings import StreamsSettings, WorkerSettings
from streams.worker import (BY_GROUP, PartitionsMismatch, declare_internal_topics, group_partitions, internal_topics,
                            seed_control_intakes)

pytestmark = pytest.mark.integration


def test_internal_topics_and_compacted_changelogs_are_declared_once(infra):
    app = create_app(infra.kafka, StreamsSettings(), WorkerSettings(app_id=f"declare-{uuid.uuid4().hex[:8]}"))
    wanted = internal_topics(app)
    assert {f"{app.conf.id}-{job}-in" for job in ("router", "aggregator", "batcher")} <= set(wanted)
    # the router and aggregator read their DESIGN topic beside their control topic; the DESIGN
    # topics belong to the infra scripts
    assert not set(wanted) & set(topics.ALL_TOPICS)
    assert sum(name.endswith("-changelog") for name in wanted) == len(app.tables)
    assert sorted(declare_internal_topics(infra.kafka, app)) == sorted(wanted)
    assert declare_internal_topics(infra.kafka, app) == []  # a second worker of the app finds them
    admin = AdminClient(infra.kafka.as_confluent())
    existing = admin.list_topics(timeout=10).topics
    for name, (partitions, _) in wanted.items():
        assert len(existing[name].partitions) == partitions, name
    changelog = next(name for name in wanted if name.endswith("batcher-state-changelog"))
    config = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, changelog)])
    assert next(iter(config.values())).result()["cleanup.policy"].value == "compact"


def test_the_jobs_take_their_partitions_from_the_topics_keyed_by_group_and_refuse_unequal_ones(infra):
    assert group_partitions(infra.kafka) == 8  # infra/topics.yaml
    admin = AdminClient(infra.kafka.as_confluent())
    tag = uuid.uuid4().hex[:8]
    uneven = {f"uneven-{tag}-a": 3, f"uneven-{tag}-b": 2}
    for future in admin.create_topics([NewTopic(n, p, 1) for n, p in uneven.items()]).values():
        future.result()
    with pytest.raises(PartitionsMismatch, match=r"uneven-.*-a \(3 partitions\), uneven-.*-b \(2 partitions\)"):
        group_partitions(infra.kafka, list(uneven))
    with pytest.raises(PartitionsMismatch, match=f"missing-{tag} do not exist"):
        group_partitions(infra.kafka, [*BY_GROUP, f"missing-{tag}"], wait_s=1)


def _control_events(kafka, topic: str) -> list[tuple[int, bytes, dict]]:
    """Every (partition, key, decoded value) in an app's control topic, from the start."""
    consumer = Consumer(kafka.as_confluent(**{"group.id": f"read-{uuid.uuid4().hex[:8]}",
                                              "enable.auto.commit": False}))
    try:
        parts = [TopicPartition(topic, p, OFFSET_BEGINNING)
                 for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
        consumer.assign([tp for tp in parts if ends[tp.partition] > 0])
        found, deadline = [], time.monotonic() + 30
        while len(found) < sum(ends.values()) and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=1):
                assert msg.error() is None, msg.error()
                found.append((msg.partition(), msg.key(), codec().decode(msg.value(), "weight_version")))
        return found
    finally:
        consumer.close()


def test_a_new_app_starts_from_the_newest_weight_version_of_its_run_not_the_whole_history(infra):
    run, other = f"seed-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    with EventProducer(infra.kafka, client_id="seed-test") as producer:
        for version in (1, 2, 5, 3):  # out of order: the highest wins, not the last
            producer.send(topics.WEIGHTS, weights(run, version), key=run)
        producer.send(topics.WEIGHTS, weights(other, 9), key=other)
        producer.flush()
    worker = WorkerSettings(app_id=f"seed-{uuid.uuid4().hex[:8]}", run=run)
    wiring = create_wiring(infra.kafka, StreamsSettings(), worker)
    declare_internal_topics(infra.kafka, wiring.app)
    sent = seed_control_intakes(infra.kafka, worker.app_id, wiring.intakes)
    assert sent == {"router-engines-intake": 0, "router-weights-intake": 8, "aggregator-weights-intake": 8,
                    "batcher-weights-intake": 1}
    for job, partitions in (("router", 8), ("aggregator", 8), ("batcher", 1)):
        events = _control_events(infra.kafka, f"{worker.app_id}-{job}-in")
        assert sorted(p for p, _, _ in events) == list(range(partitions)), job
        assert {(key, value["run"], value["version"]) for _, key, value in events} == {(run.encode(), run, 5)}
    # the app's group now starts at the end of weights and engines; a second start seeds nothing
    assert seed_control_intakes(infra.kafka, worker.app_id, wiring.intakes) is None
    assert _control_events(infra.kafka, f"{worker.app_id}-batcher-in")[0][2]["version"] == 5
