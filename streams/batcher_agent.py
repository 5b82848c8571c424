"""Batcher: groups -> batches, the Faust glue around streams/batcher_state.py.

Batch assembly is one global decision per run, so exactly one instance makes it: the intake
agent forwards every training group (decoded, validation groups left out) into the batcher's
internal topic, which has ONE partition and is keyed by run, and weight versions go into the same
partition. Kafka's consumer group gives that partition to exactly one worker at a time; the
tables (batcher_state.BatcherTables) are partitioned alike, so their single changelog partition
moves with it, and Faust's standby replicas keep a warm copy on another worker that takes over on
failure. One partition caps batching at one worker's speed; it only moves small bookkeeping plus
the groups themselves.

Claim check: a batch whose encoding exceeds the message limit (256 groups of 8k-token trajectories
are ~150 MB) is stored whole in the object store under its run, and the `batches` event carries
its URI, sha256 and size with `items` empty; the object is stored before the event is sent.

The agent applies an event's table writes only after its batch is stored and sent (a `staged`
view): a cut whose upload or send fails leaves the groups ready instead of recording them as batched.

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
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Gauge

from schemas import objectstore, topics
from schemas.codec import codec
from streams.app import Wiring
from streams.batcher_state import (TICK, BatcherTables, ClaimCheck, apply, on_batcher_event, on_store_failure,
                                   retry_pending, staged)
from streams.events import decode_from
from streams.serde import raw_table, tagged_table

log = logging.getLogger("rollstream.streams")

# What the worker's Prometheus endpoint shows of the batcher (on the worker that holds its one partition).
READY_GROUPS = Gauge("rollstream_streams_ready_groups", "Complete training groups waiting for a batch.", ["run"],
                     registry=None)
PROMETHEUS = (READY_GROUPS,)

Uploader = Callable[[str, str, bytes], Awaitable[None]]
"""Stores one object: (bucket, key, data)."""


def uploader(w: Wiring) -> Uploader:
    """Stores an object, retrying for up to store_attempt_s: a store that is briefly away must
    not cost the batch (the batch id, hence the key, is the same on every try). The client is
    made on the first claim check."""
    store: list[Any] = []

    async def upload(bucket: str, key: str, data: bytes) -> None:
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

    return upload


def _log_store_failure(metric: bytes, reason: str) -> None:
    labels = codec().decode(metric, "metric")["labels"]
    log.error("batcher: batch %s (index %s) could not be stored, %s consecutive failures: %s; "
              "its groups stay ready and are cut and stored again in %s s", labels["batch_id"],
              labels["index"], labels["consecutive_failures"], reason, labels["retry_in_s"])


async def handle_event(w: Wiring, tables: BatcherTables, data: bytes, claim: ClaimCheck, upload: Uploader) -> None:
    """One event of the batcher's topic: cut (on a staged view), store, send, then apply the view;
    a failed store applies the event without its cut and sends the failure metric instead."""
    now = w.clock()
    view = staged(tables)
    outs, uploads = on_batcher_event(view, data, now, w.settings, claim)
    try:
        for bucket, key, payload in uploads:
            await upload(bucket, key, payload)
    except Exception as error:  # noqa: BLE001 - any store failure leaves the batch to a later cut
        view = staged(tables)
        reason = f"{type(error).__name__}: {error}"
        outs = on_store_failure(view, data, outs[0][2], now, w.worker, reason)
        _log_store_failure(outs[0][2], reason)
    await w.send(outs)
    apply(view)


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
    upload = uploader(w)

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
        if retry_pending(tables):
            await batcher_in.send(key=TICK, value=TICK, partition=0)
        ready = Counter(entry["run"] for entry in tables.queue.values())
        for run in tables.state:  # every run the batcher knows, so an emptied queue reads 0
            READY_GROUPS.labels(run).set(ready[run])

    @w.app.agent(batcher_in, name="batcher")
    async def batcher(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def handle(event=event) -> None:
                await handle_event(w, tables, event.value, claim, upload)
            await w.guarded(event, "batcher", handle)
