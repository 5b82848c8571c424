"""The Faust App factory and the wiring every agent module shares.

No App exists at import time: `create_app(kafka, settings, worker)` builds one from settings, and
each agent module (router, aggregator, batcher, metrics) declares its topics, tables and agents
on it through `Wiring`. Delivery rules (ARCHITECTURE.md "Delivery guarantees"): at-least-once, no
exactly_once, every agent at concurrency 1; Faust flushes the producer before it commits source
offsets, so whatever an agent sent for an event is durable before the event counts as consumed.

Faust's own producer flush is weaker than that: table writes (the changelogs) wait in a buffer,
and its flush gives up after 0.1 s without progress, so a commit could pass changelog writes that
were never acknowledged, and a crashed worker's recovered table would lack writes whose events
count as consumed. `drain_before_commit` makes that flush wait for every buffered write.

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

Every agent decodes each event with our codec (undecodable -> `dlq` with the reason and the
event's own topic, partition and offset). Broadcasting control events into every partition lets
the per-partition agents change their tables while processing them (Faust allows table writes only
inside stream iteration). Reading the DESIGN topics directly spares each trajectory and each task
request a hop through an internal topic (a second event handled and sent by the worker's one
Python thread: bench streams measured 3.5-3.9 ms of worker CPU per trajectory with the hops,
2.9-3.05 without); the price is that producers must key these topics by group_id with one
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

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import faust
from faust.types import TopicT
from pydantic import BaseModel, ConfigDict, Field

from schemas import topics
from schemas.bus import dead_letter
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams.serde import DECODE_ERRORS, RAW, decode_from, encode_for
from streams.settings import StreamsSettings

log = logging.getLogger("rollstream.streams")

ROUTER, AGGREGATOR, BATCHER, METRICS = "router", "aggregator", "batcher", "metrics"
COMPONENTS: tuple[str, ...] = (ROUTER, AGGREGATOR, BATCHER, METRICS)


class WorkerSettings(BaseModel):
    """How one streams worker process runs (rollstream's own knobs; the paper has none)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    app_id: str = "rollstream-streams"
    """Faust app id: names the consumer group, internal topics and changelogs (one per deployment)."""
    datadir: Path = Path(".run/streams")
    """Faust's local data directory."""
    partitions: int = Field(8, ge=1)
    """Partitions of the DESIGN topics the jobs read by group_id (tasks.requested, steps, trajectories;
    infra/topics.yaml has 8): the router's, aggregator's and metrics' tables and control topics mirror
    them. `run_worker` sets it from the broker."""
    sweep_interval_s: float = Field(5.0, gt=0)
    """How often the aggregator sweeps for timed-out and stale groups."""
    metrics_interval_s: float = Field(10.0, gt=0)
    """How often per-task metrics are published to `metrics`."""
    web_enabled: bool = True
    """Serve the metrics as JSON (Faust web views)."""
    web_port: int = Field(6066, ge=1, le=65535)
    """Port of Faust's web server."""
    session_timeout_s: float = Field(10.0, gt=0)
    """Broker session timeout: a killed worker's partitions move after this long."""
    standby_replicas: int = Field(1, ge=0)
    """Faust standby replicas per table: a standby worker keeps a warm copy and takes over."""
    run: str | None = None
    """Serve only this run's events (`rollstream up` gives each run its own app); None serves every run."""
    batch_offload_bytes: int = Field(15 * 1024 * 1024, ge=1)
    """rollstream: an encoded batch above this size is stored in MinIO as a claim check (kept under Kafka's limit)."""
    store_attempt_s: float = Field(120.0, gt=0)
    """rollstream: how long one attempt to store a claim-checked batch keeps retrying (a store briefly away costs nothing)."""
    store_backoff_s: float = Field(5.0, gt=0)
    """rollstream: after a failed attempt the batch is cut and stored again this long later, doubling per failure."""
    store_backoff_max_s: float = Field(300.0, gt=0)
    """rollstream: the longest wait between two attempts to store a batch (it is retried forever, never dropped)."""
    producer_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    """rollstream: how the worker compresses what it sends. None by default: its events are small (groups and
    batches refer to the token arrays, schemas/eventref.py), the DESIGN topics' compression.type=zstd has the
    broker store them compressed anyway, and compressing in the worker's one Python thread cost it 18% more CPU
    per trajectory (bench streams: 7.3 against 6.0 ms)."""


FLUSH_TIMEOUT_S = 120.0
"""How long a commit waits for buffered table writes to be acknowledged (a broker restart takes this long)."""
STOP_FLUSH_TIMEOUT_S = 10.0
"""The same wait while the worker stops (its producer may already be gone)."""

RECORD_OVERHEAD_BYTES = 64 * 1024
"""Room left under Kafka's message limit for the key and the record and batch headers."""


def now_ms() -> int:
    return int(time.time() * 1000)


Out = tuple[str, bytes | None, bytes]
"""One event to send: (topic name, key, encoded value)."""


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
        """The encoded size above which a batch is claim-checked: the setting, but always under
        what the producer may send."""
        return min(self.worker.batch_offload_bytes, self.kafka.message_max_bytes - RECORD_OVERHEAD_BYTES)

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


def drain_before_commit(buffer: Any) -> None:
    """Makes a Faust producer buffer's flush wait until every message put in it so far is
    acknowledged by the broker (or raise, so the commit that called it does not happen)."""
    pending: set[asyncio.Future] = set()
    put = buffer.put

    def tracked_put(fut: asyncio.Future) -> None:
        pending.add(fut)
        fut.add_done_callback(pending.discard)
        put(fut)

    async def flush() -> None:
        if not pending:
            return
        timeout = STOP_FLUSH_TIMEOUT_S if buffer.should_stop else FLUSH_TIMEOUT_S
        done, waiting = await asyncio.wait(list(pending), timeout=timeout)
        if waiting:
            raise RuntimeError(f"{len(waiting)} table changelog writes not acknowledged within {timeout:g} s")
        failed = [f.exception() for f in done if not f.cancelled() and f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} table changelog writes failed: {failed[0]!r}") from failed[0]

    buffer.put = tracked_put
    buffer.flush = flush


_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def broker_credentials(kafka: KafkaSettings) -> faust.auth.Credentials | None:
    """Faust's broker credentials for the cluster's security settings (None: PLAINTEXT). A CA file
    in the librdkafka extras (ssl.ca.location) verifies the brokers; else the system's CAs do."""
    protocol = kafka.security_protocol.upper()
    if protocol == "PLAINTEXT":
        return None
    if protocol not in ("SSL", "SASL_PLAINTEXT", "SASL_SSL"):
        raise ValueError(f"security_protocol {kafka.security_protocol!r}: "
                         "use PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    context = (ssl.create_default_context(cafile=kafka.extra.get("ssl.ca.location"))
               if protocol in ("SSL", "SASL_SSL") else None)
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    mechanism = (kafka.sasl_mechanism or "").upper()
    if mechanism not in _SASL_MECHANISMS:
        raise ValueError(f"sasl_mechanism {kafka.sasl_mechanism!r}: the streams worker speaks "
                         f"{', '.join(_SASL_MECHANISMS)}")
    return faust.SASLCredentials(username=kafka.sasl_username,
                                 password=kafka.sasl_password.get_secret_value() if kafka.sasl_password else None,
                                 mechanism=mechanism, ssl_context=context)


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
        broker=kafka.faust_broker,
        broker_credentials=broker_credentials(kafka),
        datadir=str(worker.datadir),
        store="memory://",
        web_enabled=worker.web_enabled,
        web_port=worker.web_port,
        producer_acks=-1,
        producer_compression_type=None if worker.producer_compression == "none" else worker.producer_compression,
        producer_max_request_size=kafka.message_max_bytes,
        consumer_max_fetch_size=kafka.message_max_bytes,
        topic_partitions=worker.partitions,
        topic_disable_leader=True,
        table_standby_replicas=worker.standby_replicas,
        broker_session_timeout=worker.session_timeout_s,
        broker_heartbeat_interval=1,
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
