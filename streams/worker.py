"""Runs one streams worker process: the App from settings, started through mode's Worker.

Faust's click CLI is never used (pyproject.toml: it pins an incompatible click); the Worker runs
the app until SIGTERM/SIGINT and exits the process. Start more processes with the same app_id to
share the partitions; standby replicas take over a dead worker's tables.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import faust
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from faust.worker import Worker

from schemas import topics
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams.app import COMPONENTS, WorkerSettings, create_app
from streams.settings import StreamsSettings

# Data topics a new deployment may skip the history of; weights and engines are always read from
# the start, because the learner version and the engine registry are state, not a stream of work.
SKIPPABLE: tuple[str, ...] = (topics.TASKS_REQUESTED, topics.STEPS, topics.TRAJECTORIES, topics.GROUPS)


def start_at_end(kafka: KafkaSettings, app_id: str, topic_names: Iterable[str] = SKIPPABLE) -> bool:
    """For an app id that has never committed, commits the current end of each data topic, so its
    first worker starts with what is produced from now on instead of the topics' whole history.
    Returns False (and changes nothing) when the group already has committed offsets."""
    consumer = Consumer(kafka.as_confluent(**{"group.id": app_id, "enable.auto.commit": False}))
    try:
        parts = []
        for name in topic_names:
            meta = consumer.list_topics(name, timeout=10).topics[name]
            parts += [TopicPartition(name, p) for p in meta.partitions]
        if any(tp.offset >= 0 for tp in consumer.committed(parts, timeout=10)):
            return False
        ends = [TopicPartition(tp.topic, tp.partition, consumer.get_watermark_offsets(tp, timeout=10)[1])
                for tp in parts]
        consumer.commit(offsets=ends, asynchronous=False)
        return True
    finally:
        consumer.close()


def internal_topics(app: faust.App) -> dict[str, tuple[int, dict[str, str]]]:
    """The topics the app makes for itself: its agents' internal input topics and its tables'
    changelogs, {name: (partitions, config)}."""
    found: dict[str, tuple[int, dict[str, str]]] = {}
    channels = [agent.channel for agent in app.agents.values()] + [t.changelog_topic for t in app.tables.values()]
    for channel in channels:
        if getattr(channel, "internal", False):
            config = dict(channel.config or {})
            if getattr(channel, "compacting", False):  # a changelog keeps the last value of each key
                config["cleanup.policy"] = "compact"
            for name in channel.topics:
                found[name] = (channel.partitions, config)
    return found


def declare_internal_topics(kafka: KafkaSettings, app: faust.App) -> list[str]:
    """Creates the app's internal topics before its worker subscribes. Faust creates them itself
    while starting, but its consumer may subscribe first ("Ignoring missing topic") and then only
    sees them at its next metadata refresh, minutes later: measured 10 minutes of a run's first
    tasks never routed on a fresh broker. Returns the names created."""
    admin = AdminClient(kafka.as_confluent())
    existing = admin.list_topics(timeout=10).topics
    wanted = {name: spec for name, spec in internal_topics(app).items() if name not in existing}
    if not wanted:
        return []
    replicas = app.conf.topic_replication_factor
    futures = admin.create_topics([NewTopic(name, partitions, replicas, config=config)
                                   for name, (partitions, config) in wanted.items()])
    created = []
    for name, future in futures.items():
        try:
            future.result()
            created.append(name)
        except Exception as error:  # another worker of the app created it first
            if "TOPIC_ALREADY_EXISTS" not in str(error):
                raise
    return created


def run_worker(kafka: KafkaSettings, settings: StreamsSettings, worker: WorkerSettings,
               components: Iterable[str] = COMPONENTS, loglevel: str = "WARNING", *, from_now: bool = False,
               store: ObjectStoreSettings = ObjectStoreSettings()) -> None:
    """Blocks running the worker; never returns normally (mode's Worker exits the process).
    from_now: a brand-new app id skips the data topics' history (start_at_end)."""
    if from_now:
        start_at_end(kafka, worker.app_id)
    app = create_app(kafka, settings, worker, components, store=store)
    declare_internal_topics(kafka, app)
    # aiokafka logs every request at DEBUG and its loggers are left enabled: building those
    # records cost about a tenth of the worker's CPU in profiles
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLevelName(loglevel.upper())))
    runner = Worker(app, loglevel=loglevel)
    # Faust's startup spinner sets the root logger to DEBUG (its handler spins on every record) and
    # leaves it there after startup: every debug call of faust and mode then built a record to be
    # dropped, in the hot path of each event sent. A worker has no terminal to spin on.
    runner.spinner = None
    runner.execute_from_commandline()
