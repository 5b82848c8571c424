"""A new streams app's internal topics exist before its worker subscribes: on a fresh broker the
worker otherwise subscribed first, ignored the missing topics and only saw them at its next metadata
refresh (a run's first tasks waited 10 minutes in CI)."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from schemas import topics
from streams.app import WorkerSettings, create_app
from streams.settings import StreamsSettings
from streams.worker import BY_GROUP, PartitionsMismatch, declare_internal_topics, group_partitions, internal_topics

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
        group_partitions(infra.kafka, [*BY_GROUP, f"missing-{tag}"])
