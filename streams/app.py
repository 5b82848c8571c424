"""The Faust App factory and the wiring every agent module shares.

No App exists at import time: `create_app(kafka, settings, worker)` builds one from settings, and
each agent module (router, aggregator, batcher, metrics) declares its topics, tables and agents
on it through `Wiring`. Delivery rules (ARCHITECTURE.md "Delivery guarantees"): at-least-once, no
exactly_once, every agent at concurrency 1; Faust flushes the producer before it commits source
offsets, and streams/producer_buffer.py makes that flush wait for the table writes too, so whatever
an agent sent or wrote for an event is durable before the event counts as consumed. The settings
are streams/settings.py's; the Kafka client options and credentials come from streams/broker.py.

Topology. The router and the aggregator read their DESIGN topic as it is: the topic is keyed by
group_id (ARCHITECTURE.md "Topics"), so a group's events already meet in one partition, and the job's
table is partitioned like the topic. The small control events they also need (heartbeats, weight
versions, timer ticks) are broadcast into every partition of a control topic of the app,
`<app>-<job>-in`, with as many partitions as the DESIGN topics; the agent reads both topics, and
Faust assigns partition p of both (and of the changelogs) to the same worker. The batcher's one
global decision reads its own single-partition topic:

    tasks.requested ------------------------------------------ router -----> tasks
    engines, weights --broadcast--> <app>-router-in ------------^
    trajectories ---------------------------------------------- aggregator -> groups, metrics
    weights, sweep ticks --broadcast--> <app>-aggregator-in -----^
    groups --intake(key run)--> <app>-batcher-in (1 partition) --batcher--> batches
    weights ----------------------------^
    steps, trajectories --metrics--> table --timer--> metrics (and JSON at /rollstream/metrics/)
                                       `--alert rules--> alerts (streams/alerts.py)

Every agent decodes each event with our codec (undecodable -> `dlq` with the reason and the
event's own topic, partition and offset). Broadcasting control events into every partition lets
the per-partition agents change their tables while processing them (Faust allows table writes only
inside stream iteration). Reading the DESIGN topics directly spares each trajectory and each task
request a hop through an internal topic (a second event handled and sent by the worker's one
Python thread); the price is that producers must key these topics by group_id with one
partitioner, which every rollstream producer does (schemas/bus.py, librdkafka's default). The
control topics are not in order with the data: a heartbeat or weight version reaches the router
and aggregator about as soon as the requests and trajectories sent after it, not strictly before.

Control intakes (`Wiring.control_intake`) forward one event at a time and only what a receiver
can use: weight versions of the runs served, heartbeats of engines that serve them and are not
older than the liveness timeout, and of an engine's steady beats (every 2 s) only one per third of
that timeout, or one that changes what routing reads (routing.is_news). Every receiver keeps the
newest event per key (a run's highest version, an engine's latest heartbeat), so a brand-new app
need not forward the whole history of `weights` and `engines` (each event into every partition):
its worker is seeded with the newest event per key before it starts (streams/worker.py,
seed_control_intakes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import TopicT
from prometheus_client import Counter

from schemas import topics
from schemas.bus import dead_letter
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams.broker import batch_limit_bytes, client_options
from streams.events import DECODE_ERRORS, Out, decode_from, encode_for
from streams.producer_buffer import drain_before_commit
from streams.serde import RAW
from streams.settings import StreamsSettings, WorkerSettings

log = logging.getLogger("rollstream.streams")

ROUTER, AGGREGATOR, BATCHER, METRICS = "router", "aggregator", "batcher", "metrics"
COMPONENTS: tuple[str, ...] = (ROUTER, AGGREGATOR, BATCHER, METRICS)

# What the worker's Prometheus endpoint shows (schemas/prometheus.py), with the aggregator's and batcher's.
SENT = Counter("rollstream_streams_sent", "Events the jobs sent, by topic: tasks routed, groups emitted, batches "
               "cut, metrics, dead letters.", ["topic"], registry=None)
PROMETHEUS = (SENT,)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class ControlIntake:
    """One control intake: which events of `source` it broadcasts into every partition of `target`."""

    name: str
    source: str
    target: str
    partitions: int
    select: Callable[[dict[str, Any]], tuple[str, int] | None]
    """(key, order) of an event to forward, or None to leave it; the receivers keep the newest per key."""

    def newest(self, values: Iterable[bytes]) -> dict[str, bytes]:
        """The events it would forward of a history (encoded values in log order), newest per key:
        what its receivers keep of them. Undecodable events are left (the intake dead-letters them
        when it reads them itself)."""
        ranked = []
        for value in values:
            try:
                found = self.select(decode_from(self.source, value))
            except DECODE_ERRORS:
                continue
            if found is not None:
                ranked.append((*found, value))
        return newest_by_key(ranked)


@dataclass
class Wiring:
    """What the agent modules share: the app, the settings, the outgoing topics and helpers."""

    app: faust.App
    kafka: KafkaSettings
    settings: StreamsSettings
    worker: WorkerSettings
    clock: Callable[[], int]
    outgoing: dict[str, TopicT]
    tables: dict[str, Any]
    """Each job's tables by job name, for the metrics job to read (only their owner writes)."""
    store: ObjectStoreSettings
    """Where claim-checked events go."""
    intakes: list[ControlIntake] = field(default_factory=list)
    """The control intakes declared, for seeding a new app (streams/worker.py)."""

    @property
    def batch_limit_bytes(self) -> int:
        """The encoded size above which a batch is claim-checked (streams.broker.batch_limit_bytes)."""
        return batch_limit_bytes(self.kafka, self.worker)

    def serves(self, event: Any) -> bool:
        """Whether this app serves the run of a decoded event (one with a `run` field)."""
        return self.worker.run is None or event["run"] == self.worker.run

    def served_version(self, version: dict[str, Any]) -> tuple[str, int] | None:
        """A control intake's selection of weight versions: (run, version) of a run served here."""
        return (version["run"], version["version"]) if self.serves(version) else None

    def raw_topic(self, name: str, *, internal: bool = False, partitions: int | None = None) -> TopicT:
        """A topic carrying raw bytes (decoding happens per event, in the agents)."""
        return self.app.topic(name, key_type=bytes, value_type=bytes, key_serializer=RAW,
                              value_serializer=RAW, internal=internal, partitions=partitions,
                              config=self.topic_config if internal else None)

    def internal_topic(self, job: str, partitions: int) -> TopicT:
        return self.raw_topic(f"{self.worker.app_id}-{job}-in", internal=True, partitions=partitions)

    def with_control(self, design_topic: str, job: str) -> tuple[TopicT, TopicT]:
        """A job's source, the DESIGN topic and the job's control topic read together, and the
        control topic alone (to broadcast into). The control topic is co-partitioned with the
        DESIGN topic, so partition p of both reaches the agent that owns p of the job's tables."""
        control = self.internal_topic(job, self.worker.partitions)
        source = self.app.topic(design_topic, control.get_topic_name(), key_type=bytes, value_type=bytes,
                                key_serializer=RAW, value_serializer=RAW, partitions=self.worker.partitions,
                                config=self.topic_config)
        return source, control

    @property
    def topic_config(self) -> dict[str, str]:
        """Config of the topics the app creates (internal topics, changelogs): they carry whole
        groups, so they take the DESIGN topics' raised message size, not the broker's 1 MB default."""
        return {"max.message.bytes": str(self.kafka.message_max_bytes)}

    async def send(self, outs: Iterable[Out]) -> None:
        for topic, key, value in outs:
            await self.out(topic).send(key=key, value=value)
            SENT.labels(topic).inc()

    def out(self, name: str) -> TopicT:
        if name not in self.outgoing:
            self.outgoing[name] = self.raw_topic(name)
        return self.outgoing[name]

    async def broadcast(self, topic: TopicT, partitions: int, key: bytes | None, value: bytes) -> None:
        """Sends one control event into every partition of an internal topic."""
        for p in range(partitions):
            await topic.send(key=key, value=value, partition=p)

    def control_intake(self, source: str, name: str, target: TopicT, partitions: int,
                       select: Callable[[dict[str, Any]], tuple[str, int] | None]) -> None:
        """Declares an agent that broadcasts the events of `source` (weights, engines) that `select`
        keeps into every partition of `target`, keyed by the key `select` gives ((key, order), or
        None for an event this app does not need). The receivers keep only the newest event of
        each key, so a new app's worker is seeded with the newest of the history instead of
        forwarding all of it (`ControlIntake`, streams/worker.py: seed_control_intakes)."""
        intake = ControlIntake(name, source, target.get_topic_name(), partitions, select)
        self.intakes.append(intake)

        @self.app.agent(self.raw_topic(source), name=name)
        async def forward(stream):  # type: ignore[no-untyped-def]
            # one event at a time: a take buffer holds events unacknowledged, and a rebalance
            # waits for every event to be acknowledged (it hung a worker for good)
            async for event in stream.events():
                async def send(event=event) -> None:
                    found = select(decode_from(source, event.value))
                    if found is not None:
                        await self.broadcast(target, partitions, found[0].encode(), event.value)
                await self.guarded(event, name, send)

    def dead_letter(self, event: Any, error: Exception, consumer: str) -> Out:
        """The dlq event for a message that failed; the reason names the error."""
        msg = event.message
        log.warning("%s: %s[%s]@%s to dlq: %s", consumer, msg.topic, msg.partition, msg.offset, error)
        value = dead_letter(topic=msg.topic, partition=msg.partition, offset=msg.offset, key=msg.key,
                            value=msg.value, error=error, consumer=f"{self.worker.app_id}/{consumer}")
        return topics.DLQ, msg.key, encode_for(topics.DLQ, value)

    async def guarded(self, event: Any, consumer: str, handle: Callable[[], Awaitable[None]]) -> None:
        """Runs one event's work; any failure sends the event to dlq with the reason, because
        Faust acks an event whose agent raised and never retries it."""
        try:
            await handle()
        except Exception as error:  # noqa: BLE001 - every failure is routed, none is lost
            if not isinstance(error, ValueError):
                log.exception("%s: unexpected failure", consumer)
            await self.send([self.dead_letter(event, error, consumer)])


def newest_by_key(ranked: Iterable[tuple[str, int, Any]]) -> dict[str, Any]:
    """The item of highest order for each key, of (key, order, item) in arrival order; of equal
    orders the later one."""
    newest: dict[str, tuple[int, Any]] = {}
    for key, order, item in ranked:
        if key not in newest or order >= newest[key][0]:
            newest[key] = (order, item)
    return {key: item for key, (_, item) in newest.items()}


def create_app(kafka: KafkaSettings, settings: StreamsSettings, worker: WorkerSettings = WorkerSettings(),
               components: Iterable[str] = COMPONENTS, *, clock: Callable[[], int] = now_ms,
               store: ObjectStoreSettings = ObjectStoreSettings()) -> faust.App:
    """A Faust App running the chosen jobs (all four by default) with these settings."""
    return create_wiring(kafka, settings, worker, components, clock=clock, store=store).app


def create_wiring(kafka: KafkaSettings, settings: StreamsSettings, worker: WorkerSettings = WorkerSettings(),
                  components: Iterable[str] = COMPONENTS, *, clock: Callable[[], int] = now_ms,
                  store: ObjectStoreSettings = ObjectStoreSettings()) -> Wiring:
    """The app of create_app with what its jobs declared on it (tables, control intakes)."""
    chosen = list(components)
    unknown = sorted(set(chosen) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"unknown streams components {unknown}; known: {', '.join(COMPONENTS)}")
    app = faust.App(
        worker.app_id,
        **client_options(kafka, worker),
        datadir=str(worker.datadir),
        store="memory://",
        web_enabled=worker.web_enabled,
        web_port=worker.web_port,
        topic_partitions=worker.partitions,
        topic_disable_leader=True,
        table_standby_replicas=worker.standby_replicas,
    )
    drain_before_commit(app.producer.buffer)
    wiring = Wiring(app, kafka, settings, worker, clock, {}, {}, store)
    # Imported here: the agent modules only declare things on an app handed to them.
    from streams import aggregator_agent, batcher_agent, metrics_agent, router_agent

    registrars = {ROUTER: router_agent.register, AGGREGATOR: aggregator_agent.register,
                  BATCHER: batcher_agent.register, METRICS: metrics_agent.register}
    for name in COMPONENTS:
        if name in chosen:
            registrars[name](wiring)
    return wiring
