"""Batcher: groups -> batches, cut by batching.plan_batch / build_batch on the learner's credit.

Batch assembly is one global decision per run, so exactly one instance makes it: the intake
agent forwards every training group (decoded, validation groups left out) into the batcher's
internal topic, which has ONE partition and is keyed by run, and weight versions go into the same
partition. Kafka's consumer group gives that partition to exactly one worker at a time; the
tables below are partitioned alike, so their single changelog partition moves with it, and
Faust's standby replicas keep a warm copy on another worker that takes over on failure. One
partition caps batching at one worker's speed; it only moves small bookkeeping plus the groups
themselves, which the bench shows is far above the paper's rate.

Credit: the learner publishes a weight version after every step; batch k answers credit version
v (recorded in the batch), and batch k+1 may be cut once a version newer than v is published.
The first batch needs no credit (it answers the learner's version at that time, 0 before any).

Tables (one partition):
- `batcher-state` run -> {"learner_version", "answered", "index", "available" (trainable
  trajectories ready), "next_seq", "store_failures", "retry_at_ms"};
- `batcher-queue` group_id -> {"run", "seq" (arrival order in its run), and what plan_batch needs
  of the group}, until it is batched;
- `batcher-ready` group_id -> the group event as received (raw bytes), until it is batched;
- `batcher-batched` group_id -> {"batch_id", "at_ms"}: a redelivered group that was already
  trained is dropped. Entries go after closed_retention_s (at the cuts), the horizon over which the
  aggregator drops duplicates too; kept forever they grew with every group a run ever trained.
A group's arrival writes its own small entries and the run's fixed-size state, never a list of
every ready group: a first batch at the paper's size waits for 436 groups, and rewriting all their
summaries with each one wrote 42 MB to the state's changelog before that batch was cut (measured;
0.2 MB to state and queue together now). The queue is gathered, once per cut, only when the run's
count says a batch is due.

Claim check: a batch whose encoding exceeds the message limit (256 groups of 8k-token trajectories
are ~150 MB) is stored whole in the object store under its run, and the `batches` event carries
its URI, sha256 and size with `items` empty; the object is stored before the event is sent.

The agent applies an event's table writes only after its batch is stored and sent (`Staged`): a
cut whose upload or send fails leaves the groups ready instead of recording them as batched.

A store that stays away: one attempt retries for `store_attempt_s`; when it still fails, the event
is applied without its cut (`on_store_failure`: its group stays ready, its credit stays open), the
failure is logged with its reason and reported as a `metric` named streams/batch_store_failed, and
the run's state holds when to try again (`store_retry_at`: exponential backoff, capped, forever).
The next event of the run after that time, or a tick that a timer sends while a run has a failed
store, cuts again from the then ready groups. Nothing is lost and no batch id is sent twice: the
failed batch was never sent, and a retried cut taking the same groups has the same id and key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from schemas import objectstore, topics
from schemas.codec import codec
from streams import batching
from streams.app import Out, WorkerSettings, Wiring
from streams.serde import decode_from, encode_for, raw_table, tagged_table
from streams.settings import StreamsSettings

GROUP, WEIGHTS = "group", "weight_version"
TICK = b"tick"
STORE_FAILED_METRIC = "streams/batch_store_failed"
log = logging.getLogger("rollstream.streams")

Upload = tuple[str, str, bytes]
"""An object to store before the outgoing events are sent: (bucket, key, data)."""


@dataclass(frozen=True)
class ClaimCheck:
    """Where a batch too large for one message goes, and from what encoded size on."""

    bucket: str
    limit_bytes: int


def payload_key(run: str, batch_id: str) -> str:
    """The object key of a stored batch: under its run, named by its deterministic id."""
    return f"{run}/batches/{batch_id}.avro"


def batch_out(batch: dict[str, Any], claim: ClaimCheck | None) -> tuple[Out, list[Upload]]:
    """The batches event of a batch, inline or, above the claim check's limit, as a claim check
    with the object to store first."""
    data = encode_for(topics.BATCHES, batch)
    key = batch["batch_id"].encode()
    if claim is None or len(data) <= claim.limit_bytes:
        return (topics.BATCHES, key, data), []
    object_key = payload_key(batch["run"], batch["batch_id"])
    pointer = objectstore.claim_check(batch, objectstore.uri(claim.bucket, object_key), data, {"items": []})
    return (topics.BATCHES, key, encode_for(topics.BATCHES, pointer)), [(claim.bucket, object_key, data)]


@dataclass
class BatcherTables:
    """The batcher's tables (Faust tables in the worker, plain dicts in unit tests)."""

    state: MutableMapping[str, dict[str, Any]]
    ready: MutableMapping[str, bytes]
    batched: MutableMapping[str, dict[str, Any]]
    queue: MutableMapping[str, dict[str, Any]] = field(default_factory=dict)

    def all(self) -> tuple[MutableMapping[str, Any], ...]:
        return self.state, self.ready, self.batched, self.queue


_DELETED = object()


class Staged(MutableMapping):
    """A table seen through writes not yet made: reads see them, `apply()` makes them."""

    def __init__(self, table: MutableMapping[str, Any]) -> None:
        self.table = table
        self.writes: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key in self.writes:
            if self.writes[key] is _DELETED:
                raise KeyError(key)
            return self.writes[key]
        return self.table[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.writes[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self.writes[key] = _DELETED

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.table if k not in self.writes)
        yield from (k for k, v in self.writes.items() if v is not _DELETED)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def apply(self) -> None:
        for key, value in self.writes.items():
            if value is not _DELETED:
                self.table[key] = value
            elif key in self.table:
                del self.table[key]
        self.writes.clear()


def staged(tables: BatcherTables) -> BatcherTables:
    return BatcherTables(*(Staged(table) for table in tables.all()))


def apply(view: BatcherTables) -> None:
    """Makes the writes staged in a view of the tables (after its batch is stored and sent)."""
    for table in view.all():
        table.apply()


def empty_state() -> dict[str, Any]:
    return {"learner_version": None, "answered": None, "index": 0, "available": 0, "next_seq": 0,
            "store_failures": 0, "retry_at_ms": None}


def run_state(tables: BatcherTables, run: str) -> dict[str, Any]:
    """The run's state. One written before the queue table, with its list of ready summaries in
    it, has that list moved into the queue (in its order) so a worker upgraded mid-run loses no
    ready group."""
    state = tables.state.get(run)
    if state is None:
        return empty_state()
    if "ready" not in state:
        return state
    legacy = {key: value for key, value in state.items() if key != "ready"}
    for seq, entry in enumerate(state["ready"]):
        tables.queue[entry["group_id"]] = {**entry, "run": run, "seq": seq}
    return {**empty_state(), **legacy, "available": sum(len(batching.trainable_members(g)) for g in state["ready"]),
            "next_seq": len(state["ready"])}


def queued(tables: BatcherTables, run: str) -> list[dict[str, Any]]:
    """The run's ready groups as plan_batch takes them, in arrival order."""
    return sorted((entry for entry in tables.queue.values() if entry["run"] == run), key=lambda entry: entry["seq"])


def store_retry_at(failures: int, now_ms: int, worker: WorkerSettings) -> int:
    """When a run may cut and store again after `failures` consecutive failed attempts: after
    store_backoff_s, doubling with each failure up to store_backoff_max_s."""
    delay_s = min(worker.store_backoff_s * 2 ** min(failures - 1, 32), worker.store_backoff_max_s)
    return now_ms + int(delay_s * 1000)


def store_due(state: dict[str, Any], now_ms: int) -> bool:
    """Whether the run may cut now: no failed store pending, or its backoff has passed. (States
    written before stores could fail lack the field.)"""
    retry_at = state.get("retry_at_ms")
    return retry_at is None or now_ms >= retry_at


def summary(group: dict[str, Any]) -> dict[str, Any]:
    """What plan_batch needs of a ready group (the full event stays in `batcher-ready`)."""
    return {"group_id": group["group_id"], "validation": group["validation"],
            "members": [{"masked": m["masked"]} for m in group["members"]]}


def credit(state: dict[str, Any]) -> int | None:
    """The learner version the next batch answers, or None while the last one is unanswered."""
    version = state["learner_version"]
    if state["answered"] is None:
        return version if version is not None else 0
    return version if version is not None and version > state["answered"] else None


def forget_old_batched(batched: MutableMapping[str, Any], now_ms: int, settings: StreamsSettings) -> None:
    """Deletes the batched records older than closed_retention_s. One from before records had a
    time (a bare batch id) is dated now, so it goes one retention later."""
    horizon_ms = settings.closed_retention_s * 1000
    for gid, record in list(batched.items()):
        if not isinstance(record, dict):
            batched[gid] = {"batch_id": record, "at_ms": now_ms}
        elif now_ms - record["at_ms"] >= horizon_ms:
            del batched[gid]


def _try_cut(tables: BatcherTables, run: str, state: dict[str, Any], now_ms: int, settings: StreamsSettings,
             claim: ClaimCheck | None) -> tuple[dict[str, Any], list[Out], list[Upload]]:
    version = credit(state)
    if batching.wait_reason(state["available"], version, state["index"], settings) is not None:
        return state, [], []
    plan = batching.plan_batch(queued(tables, run), version, state["index"], settings)
    if not plan.cut:
        return state, [], []
    groups = [codec().decode(tables.ready[g["group_id"]], GROUP) for g in plan.groups]
    batch = batching.build_batch(run, state["index"], version, groups, settings, now_ms)
    # encoded before the tables change: a batch that fails to encode changes nothing
    out, uploads = batch_out(batch, claim)
    for g in plan.groups:
        tables.batched[g["group_id"]] = {"batch_id": batch["batch_id"], "at_ms": now_ms}
        del tables.ready[g["group_id"]]
        del tables.queue[g["group_id"]]
    state = {**state, "available": state["available"] - plan.trajectories, "index": state["index"] + 1,
             "answered": version, "store_failures": 0, "retry_at_ms": None}
    forget_old_batched(tables.batched, now_ms, settings)
    return state, [out], uploads


def _absorb(tables: BatcherTables, data: bytes) -> str | None:
    """Applies a group or a weight version to its run's state without cutting; returns the run
    (None for a redelivered group, which changes nothing)."""
    if codec().event_type_of(data) == WEIGHTS:
        version = codec().decode(data, WEIGHTS)
        run = version["run"]
        state = run_state(tables, run)
        if state["learner_version"] is None or version["version"] > state["learner_version"]:
            state = {**state, "learner_version": version["version"]}
    else:
        group = codec().decode(data, GROUP)
        run, gid = group["run"], group["group_id"]
        state = run_state(tables, run)
        if gid in tables.batched or gid in tables.ready:
            return None  # a redelivered group: already ready or trained
        tables.ready[gid] = data
        tables.queue[gid] = {**summary(group), "run": run, "seq": state["next_seq"]}
        state = {**state, "next_seq": state["next_seq"] + 1,
                 "available": state["available"] + len(batching.trainable_members(group))}
    tables.state[run] = state
    return run


def failed_store_due(tables: BatcherTables, now_ms: int) -> str | None:
    """The first run (by name) whose failed store may be retried now, if any."""
    return next((run for run, state in sorted(tables.state.items())
                 if state.get("store_failures") and store_due(state, now_ms)), None)


def on_batcher_event(tables: BatcherTables, data: bytes, now_ms: int, settings: StreamsSettings,
                     claim: ClaimCheck | None = None) -> tuple[list[Out], list[Upload]]:
    """Applies a group or a weight version to its run's state, or a tick (which retries one run's
    failed store when due); returns the batch if one is cut (and, for a claim check, the object to
    store before sending it). A run waiting out a failed store's backoff cuts nothing."""
    run = failed_store_due(tables, now_ms) if data == TICK else _absorb(tables, data)
    state = None if run is None else run_state(tables, run)
    if state is None or not store_due(state, now_ms):
        return [], []
    state, outs, uploads = _try_cut(tables, run, state, now_ms, settings, claim)
    tables.state[run] = state
    return outs, uploads


def on_store_failure(tables: BatcherTables, data: bytes, pointer: bytes, now_ms: int, worker: WorkerSettings,
                     reason: str) -> list[Out]:
    """After the batch cut for `data` (its event: `pointer`) could not be stored: applies `data`
    without the cut (its group stays ready, its credit open) and records the failure with the time
    to try again; returns the metric event that reports it (value 1 per failure)."""
    if data != TICK:
        _absorb(tables, data)
    batch = codec().decode(pointer, "batch")
    run = batch["run"]
    state = tables.state[run]
    failures = state.get("store_failures", 0) + 1
    retry_at = store_retry_at(failures, now_ms, worker)
    tables.state[run] = {**state, "store_failures": failures, "retry_at_ms": retry_at}
    metric = {"run": run, "name": STORE_FAILED_METRIC, "value": 1.0, "step": state["learner_version"],
              "labels": {"batch_id": batch["batch_id"], "index": str(batch["index"]),
                         "consecutive_failures": str(failures), "retry_in_s": f"{(retry_at - now_ms) / 1000:g}",
                         "reason": reason},
              "source": "streams/batcher", "at_ms": now_ms}
    return [(topics.METRICS, STORE_FAILED_METRIC.encode(), encode_for(topics.METRICS, metric))]


def register(w: Wiring) -> None:
    """Declares the batcher's intake agents, its one-partition tables and the batching agent."""
    batcher_in = w.internal_topic("batcher", 1)
    tables = BatcherTables(
        state=tagged_table(w.app, "batcher-state", 1, w.topic_config),
        ready=raw_table(w.app, "batcher-ready", 1, w.topic_config),
        batched=tagged_table(w.app, "batcher-batched", 1, w.topic_config),
        queue=tagged_table(w.app, "batcher-queue", 1, w.topic_config),
    )
    w.tables["batcher"] = tables
    claim = ClaimCheck(topics.PAYLOADS_BUCKET, w.batch_limit_bytes)
    store: list[Any] = []  # the object store client, made on the first claim check

    async def upload(bucket: str, key: str, data: bytes) -> None:
        """Stores an object, retrying for up to store_attempt_s: a store that is briefly away must
        not cost the batch (the batch id, hence the key, is the same on every try)."""
        if not store:
            store.append(objectstore.client(w.store))
        deadline, delay = time.monotonic() + w.worker.store_attempt_s, 0.5
        while True:
            try:
                # the SDK blocks: off the event loop, which keeps serving the other agents meanwhile
                await asyncio.to_thread(objectstore.put_bytes, store[0], bucket, key, data)
                return
            except Exception as error:  # noqa: BLE001 - any store failure is retried until the deadline
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("batcher: storing %s/%s failed (%s); retrying in %.1f s", bucket, key, error, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    @w.app.agent(w.raw_topic(topics.GROUPS), name="batcher-intake")
    async def groups_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                group = decode_from(topics.GROUPS, event.value)
                if not group["validation"] and w.serves(group):  # validation groups are evaluated, never trained
                    await batcher_in.send(key=group["run"].encode(), value=event.value, partition=0)
            await w.guarded(event, "batcher-intake", forward)

    w.control_intake(topics.WEIGHTS, "batcher-weights-intake", batcher_in, 1, w.served_version)

    @w.app.timer(w.worker.sweep_interval_s, name="batcher-retry")
    async def retry_ticks() -> None:
        # Reads the local table copy: ticks only while a run waits to retry a failed store (a
        # standby's stale copy may send a needless one, which cuts nothing).
        if any(state.get("store_failures") for state in tables.state.values()):
            await batcher_in.send(key=TICK, value=TICK, partition=0)

    @w.app.agent(batcher_in, name="batcher")
    async def batcher(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def handle(event=event) -> None:
                now = w.clock()
                view = staged(tables)
                outs, uploads = on_batcher_event(view, event.value, now, w.settings, claim)
                try:
                    for bucket, key, data in uploads:
                        await upload(bucket, key, data)
                except Exception as error:  # noqa: BLE001 - any store failure leaves the batch to a later cut
                    view = staged(tables)
                    reason = f"{type(error).__name__}: {error}"
                    outs = on_store_failure(view, event.value, outs[0][2], now, w.worker, reason)
                    labels = codec().decode(outs[0][2], "metric")["labels"]
                    log.error("batcher: batch %s (index %s) could not be stored, %s consecutive failures: %s; "
                              "its groups stay ready and are cut and stored again in %s s", labels["batch_id"],
                              labels["index"], labels["consecutive_failures"], reason, labels["retry_in_s"])
                await w.send(outs)
                apply(view)
            await w.guarded(event, "batcher", handle)
