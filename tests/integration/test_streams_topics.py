"""A new streams app's internal topics exist before its worker subscribes: on a fresh broker the
worker otherwise subscribed first, ignored the missing topics and only saw them at its next metadata
refresh (a run's first tasks waited 10 minutes in CI)."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from streams.app import WorkerSettings, create_app
from streams.settings import StreamsSettings
from streams.worker import declare_internal_topics, internal_topics

pytestmark = pytest.mark.integration


def test_internal_topics_and_compacted_changelogs_are_declared_once(infra):
    app = create_app(infra.kafka, StreamsSettings(), WorkerSettings(app_id=f"declare-{uuid.uuid4().hex[:8]}"))
    wanted = internal_topics(app)
    assert {f"{app.conf.id}-{job}-in" for job in ("router", "aggregator", "batcher")} <= set(wanted)
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
