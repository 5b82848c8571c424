"""Runs one streams worker process: the App from settings, started through mode's Worker.

Faust's click CLI is never used (pyproject.toml: it pins an incompatible click); the Worker runs
the app until SIGTERM/SIGINT and exits the process. Start more processes with the same app_id to
share the partitions; standby replicas take over a dead worker's tables.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable

import faust
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from faust.worker import Worker

from schemas import topics
from schemas.bus import EventProducer, create_missing_topics, topic_partitions
from schemas.eventref import retrying
from schemas.prometheus import serve_metrics
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams import aggregator_agent, batcher_agent
from streams import app as streams_app
from streams.app import COMPONENTS, ControlIntake, create_wiring
from streams.settings import StreamsSettings, WorkerSettings

# Data topics a new deployment may skip the history of; weights and engines are always read from
# the start, because the learner version and the engine registry are state, not a stream of work.
SKIPPABLE: tuple[str, ...] = (topics.TASKS_REQUESTED, topics.STEPS, topics.TRAJECTORIES, topics.GROUPS)


def never_committed(consumer: Consumer, topic_names: Iterable[str]) -> list[TopicPartition] | None:
    """The partitions of these topics, or None when the consumer's group has committed on any."""
    parts = []
    for name in topic_names:
        meta = consumer.list_topics(name, timeout=10).topics[name]
        parts += [TopicPartition(name, p) for p in meta.partitions]
    # A group the broker has never seen may answer NOT_COORDINATOR while its coordinator is being
    # chosen (seen in CI at the start of a run): transient, so retried.
    committed = retrying(lambda: consumer.committed(parts, timeout=10), "reading a group's committed offsets")
    if any(tp.offset >= 0 for tp in committed):
        return None
    return parts


def start_at_end(kafka: KafkaSettings, app_id: str, topic_names: Iterable[str] = SKIPPABLE) -> bool:
    """For an app id that has never committed, commits the current end of each data topic, so its
    first worker starts with what is produced from now on instead of the topics' whole history.
    Returns False (and changes nothing) when the group already has committed offsets."""
    consumer = Consumer(kafka.as_confluent(**{"group.id": app_id, "enable.auto.commit": False}))
    try:
        parts = never_committed(consumer, topic_names)
        if parts is None:
            return False
        ends = [TopicPartition(tp.topic, tp.partition,
                               retrying(lambda tp=tp: consumer.get_watermark_offsets(tp, timeout=10), "reading an end offset")[1])
                for tp in parts]
        retrying(lambda: consumer.commit(offsets=ends, asynchronous=False), f"committing the start of {app_id}")
        return True
    finally:
        consumer.close()


SEED_READ_TIMEOUT_S = 120.0
"""How long seeding a new app may take to read the history of its control sources."""


def read_history(consumer: Consumer, parts: list[TopicPartition], timeout_s: float = SEED_READ_TIMEOUT_S
                 ) -> tuple[dict[str, list[bytes]], list[TopicPartition]]:
    """Every event of these topic partitions up to their current end ({topic: values in log order
    per partition}) and those ends."""
    ends, remaining = [], {}
    for tp in parts:
        low, high = retrying(lambda tp=tp: consumer.get_watermark_offsets(tp, timeout=10), "reading a control source's offsets")
        ends.append(TopicPartition(tp.topic, tp.partition, high))
        if high > low:
            remaining[(tp.topic, tp.partition)] = high
    history: dict[str, list[bytes]] = {tp.topic: [] for tp in parts}
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in remaining])
    deadline = time.monotonic() + timeout_s
    while remaining:
        if time.monotonic() > deadline:
            raise TimeoutError(f"reading {sorted(remaining)} to their end took over {timeout_s:g} s")
        for msg in consumer.consume(1000, timeout=1):
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(f"reading {msg.topic()}[{msg.partition()}]: {msg.error()}")
            where = (msg.topic(), msg.partition())
            if where not in remaining or msg.offset() >= remaining[where]:
                continue
            history[msg.topic()].append(msg.value())
            if msg.offset() >= remaining[where] - 1:
                del remaining[where]
    return history, ends


def seed_control_intakes(kafka: KafkaSettings, app_id: str, intakes: Iterable[ControlIntake]) -> dict[str, int] | None:
    """For an app id that has never committed on its control sources (weights, engines), sends what
    its control intakes would leave in their targets after reading the sources' whole history (the
    newest event of each key, ControlIntake.newest) and commits the sources' current end, so its
    first worker starts current. Forwarding every weight version and heartbeat ever sent into every
    partition cost a new app on a long-lived broker minutes of catching up. Returns the events each
    intake sent (by name), or None, changing nothing, when the app has committed on them already.
    Seeding twice (a crash before the commit) sends the same newest events again: receivers keep
    the newest per key, so nothing changes."""
    intakes = list(intakes)
    sources = sorted({intake.source for intake in intakes})
    if not sources:
        return None
    consumer = Consumer(kafka.as_confluent(**{"group.id": app_id, "enable.auto.commit": False}))
    try:
        parts = never_committed(consumer, sources)
        if parts is None:
            return None
        history, ends = read_history(consumer, parts)
        sent: dict[str, int] = {}
        with EventProducer(kafka, client_id=f"{app_id}-seed") as producer:  # raises unless all are acknowledged
            for intake in intakes:
                newest = intake.newest(history[intake.source])
                for key, value in newest.items():
                    for partition in range(intake.partitions):
                        producer.send_raw(intake.target, value, key, partition=partition)
                sent[intake.name] = len(newest) * intake.partitions
        retrying(lambda: consumer.commit(offsets=ends, asynchronous=False), f"committing the seed of {app_id}")
        return sent
    finally:
        consumer.close()


def internal_topics(app: faust.App) -> dict[str, tuple[int, dict[str, str]]]:
    """The topics the app makes for itself, {name: (partitions, config)}: its tables' changelogs
    and the topics its agents read that are named after the app (internal intakes, and the control
    topics read together with a DESIGN topic, which the infra scripts own)."""
    found: dict[str, tuple[int, dict[str, str]]] = {}
    prefix = f"{app.conf.id}-"
    channels = [agent.channel for agent in app.agents.values()] + [t.changelog_topic for t in app.tables.values()]
    for channel in channels:
        config = dict(getattr(channel, "config", None) or {})
        if getattr(channel, "compacting", False):  # a changelog keeps the last value of each key
            config["cleanup.policy"] = "compact"
        for name in getattr(channel, "topics", ()):
            if name.startswith(prefix):
                found[name] = (channel.partitions, config)
    return found


class PartitionsMismatch(ValueError):
    """The DESIGN topics a worker reads by group_id have different partition counts."""


BY_GROUP: tuple[str, ...] = (topics.TASKS_REQUESTED, topics.STEPS, topics.TRAJECTORIES)
"""The DESIGN topics keyed by group_id that the jobs' tables are partitioned like."""


def group_partitions(kafka: KafkaSettings, topic_names: Iterable[str] = BY_GROUP, wait_s: float = 10.0) -> int:
    """The partition count of the DESIGN topics the jobs read by group_id (the same for all of
    them, or PartitionsMismatch: a table and its changelog must be partitioned like its source).
    wait_s: how long a topic may take to appear (one created a moment ago)."""
    counts = topic_partitions(AdminClient(kafka.as_confluent()), topic_names, wait_s)
    missing = sorted(name for name, n in counts.items() if n == 0)
    if missing:
        raise PartitionsMismatch(f"topics {', '.join(missing)} do not exist: create them first "
                                 "(rollstream infra init)")
    if len(set(counts.values())) != 1:
        raise PartitionsMismatch("the streams jobs read " + ", ".join(f"{n} ({c} partitions)" for n, c in counts.items())
                                 + " by group_id and need them partitioned alike")
    return next(iter(counts.values()))


def declare_internal_topics(kafka: KafkaSettings, app: faust.App) -> list[str]:
    """Creates the app's internal topics before its worker subscribes. Faust creates them itself
    while starting, but its consumer may subscribe first ("Ignoring missing topic") and then only
    sees them at its next metadata refresh, minutes later: measured 10 minutes of a run's first
    tasks never routed on a fresh broker. Returns the names created."""
    admin = AdminClient(kafka.as_confluent())
    existing = admin.list_topics(timeout=10).topics
    replicas = app.conf.topic_replication_factor
    # another worker of the app may create them at the same time
    return create_missing_topics(admin, [NewTopic(name, partitions, replicas, config=config)
                                         for name, (partitions, config) in internal_topics(app).items()
                                         if name not in existing])


def run_worker(kafka: KafkaSettings, settings: StreamsSettings, worker: WorkerSettings,
               components: Iterable[str] = COMPONENTS, loglevel: str = "WARNING", *, from_now: bool = False,
               store: ObjectStoreSettings = ObjectStoreSettings()) -> None:
    """Blocks running the worker; never returns normally (mode's Worker exits the process).
    from_now: a brand-new app id skips the data topics' history (start_at_end)."""
    if from_now:
        start_at_end(kafka, worker.app_id)
    worker = worker.model_copy(update={"partitions": group_partitions(kafka)})
    wiring = create_wiring(kafka, settings, worker, components, store=store)
    app = wiring.app
    declare_internal_topics(kafka, app)
    seeded = seed_control_intakes(kafka, worker.app_id, wiring.intakes)
    if seeded is not None:
        # before the Worker configures logging: straight to stderr
        print(f"new app {worker.app_id}: its control intakes were seeded with the newest of their sources' "
              f"history ({seeded})", file=sys.stderr)
    # aiokafka logs every request at DEBUG and its loggers are left enabled: building those
    # records cost about a tenth of the worker's CPU in profiles
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLevelName(loglevel.upper())))
    serve_metrics(worker.metrics_port, "streams",
                  [*streams_app.PROMETHEUS, *aggregator_agent.PROMETHEUS, *batcher_agent.PROMETHEUS],
                  host=worker.metrics_host)
    runner = Worker(app, loglevel=loglevel)
    # Faust's startup spinner sets the root logger to DEBUG (its handler spins on every record) and
    # leaves it there after startup: every debug call of faust and mode then built a record to be
    # dropped, in the hot path of each event sent. A worker has no terminal to spin on.
    runner.spinner = None
    runner.execute_from_commandline()
