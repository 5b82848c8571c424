"""The batcher's state machine over its tables, as pure logic: groups, weight versions and retry
ticks in; batches (with the objects to store first) and store-failure metrics out.

The tables are plain mappings here (Faust tables in the worker, dicts in unit tests); nothing here
imports Faust, Kafka or the object store, and the clock reading `now_ms` is passed in. The agent
module (streams/batcher_agent.py) decodes nothing itself: it hands each event's bytes to
`on_batcher_event` through a `staged` view, stores and sends what it returns, then `apply`s the view.

Tables (one partition):
- `state` run -> {"learner_version", "answered", "index", "available" (trainable trajectories
  ready), "next_seq", "store_failures", "retry_at_ms"} (`empty_state`);
- `queue` group_id -> {"run", "seq" (arrival order in its run), and what plan_batch needs of the
  group (`summary`)}, until it is batched;
- `ready` group_id -> the group event as received (raw bytes), until it is batched;
- `batched` group_id -> {"batch_id", "at_ms"}: a redelivered group that was already trained is
  dropped (a group the windowed FIFO dropped has batch_id None and "dropped": its reason). Entries go after closed_retention_s (at the cuts), the horizon over which the
  aggregator drops duplicates too.
A group's arrival writes its own small entries and the run's fixed-size state, never a list of
every ready group (which would be rewritten, whole, into the state's changelog with each arrival);
the queue is gathered, once per cut, only when the run's count says a batch is due.

Credit: the learner publishes a weight version after every step; batch k answers credit version
v (recorded in the batch), and batch k+1 may be cut once a version newer than v is published.
The first batch needs no credit (it answers the learner's version at that time, 0 before any).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from schemas import objectstore, topics
from schemas.codec import codec
from streams import batching
from streams.events import Out, encode_for
from streams.settings import StreamsSettings, WorkerSettings

GROUP, WEIGHTS, BATCH = "group", "weight_version", "batch"
TICK = b"tick"
"""The retry timer's event: cut again for a run whose failed store is due."""
STORE_FAILED_METRIC = "streams/batch_store_failed"

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
    """A view of the tables whose writes wait for `apply` (after the batch is stored and sent)."""
    return BatcherTables(*(Staged(table) for table in tables.all()))


def apply(view: BatcherTables) -> None:
    """Makes the writes staged in a view of the tables (after its batch is stored and sent)."""
    for table in view.all():
        table.apply()


def empty_state() -> dict[str, Any]:
    return {"learner_version": None, "answered": None, "index": 0, "available": 0, "next_seq": 0,
            "store_failures": 0, "retry_at_ms": None}


def run_state(tables: BatcherTables, run: str) -> dict[str, Any]:
    """The run's state (`empty_state` for a run not seen yet)."""
    return tables.state.get(run) or empty_state()


def queued(tables: BatcherTables, run: str) -> list[dict[str, Any]]:
    """The run's ready groups as plan_batch takes them, in arrival order."""
    return sorted((entry for entry in tables.queue.values() if entry["run"] == run), key=lambda entry: entry["seq"])


def store_retry_at(failures: int, now_ms: int, worker: WorkerSettings) -> int:
    """When a run may cut and store again after `failures` consecutive failed attempts: after
    store_backoff_s, doubling with each failure up to store_backoff_max_s."""
    delay_s = min(worker.store_backoff_s * 2 ** min(failures - 1, 32), worker.store_backoff_max_s)
    return now_ms + int(delay_s * 1000)


def store_due(state: dict[str, Any], now_ms: int) -> bool:
    """Whether the run may cut now: no failed store pending, or its backoff has passed."""
    return state["retry_at_ms"] is None or now_ms >= state["retry_at_ms"]


def summary(group: dict[str, Any]) -> dict[str, Any]:
    """What plan_batch needs of a ready group (the full event stays in `ready`)."""
    return {"group_id": group["group_id"], "validation": group["validation"],
            "members": [{"masked": m["masked"]} for m in group["members"]],
            # for batching.split_by_window and the drop metric's label, without decoding the group
            "task": group["task"], "first_arrival_ms": group["first_arrival_ms"]}


def credit(state: dict[str, Any]) -> int | None:
    """The learner version the next batch answers, or None while the last one is unanswered."""
    version = state["learner_version"]
    if state["answered"] is None:
        return version if version is not None else 0
    return version if version is not None and version > state["answered"] else None


def forget_old_batched(batched: MutableMapping[str, Any], now_ms: int, settings: StreamsSettings) -> None:
    """Deletes the batched records older than closed_retention_s."""
    horizon_ms = settings.closed_retention_s * 1000
    for gid, record in list(batched.items()):
        if now_ms - record["at_ms"] >= horizon_ms:
            del batched[gid]


def _try_cut(tables: BatcherTables, run: str, state: dict[str, Any], now_ms: int, settings: StreamsSettings,
             claim: ClaimCheck | None) -> tuple[dict[str, Any], list[Out], list[Upload]]:
    version = credit(state)
    if batching.wait_reason(state["available"], version, state["index"], settings) is not None:
        return state, [], []
    ready, expired = batching.split_by_window(queued(tables, run), now_ms, settings)
    state, dropped = _drop(tables, run, state, expired, batching.WINDOW_REASON, now_ms)
    plan = batching.plan_batch(ready, version, state["index"], settings)
    if not plan.cut:
        return state, dropped, []
    groups = [codec().decode(tables.ready[g["group_id"]], GROUP) for g in plan.groups]
    groups, filtered = batching.variance_filter(groups, settings)
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
    # the batch first: a failed store reads its event from outs[0] (batcher_agent.handle_event)
    return state, [out, *dropped, *_drop_metrics(run, state, filtered, batching.VARIANCE_REASON, now_ms)], uploads


def _drop_metrics(run: str, state: dict[str, Any], groups: list[Any], reason: str, now_ms: int) -> list[Out]:
    metrics = [batching.dropped_metric(run, g, reason, state["learner_version"], now_ms) for g in groups]
    return [(topics.METRICS, topics.GROUP_DROPPED_METRIC.encode(), encode_for(topics.METRICS, m)) for m in metrics]


def _drop(tables: BatcherTables, run: str, state: dict[str, Any], groups: list[Any], reason: str, now_ms: int
          ) -> tuple[dict[str, Any], list[Out]]:
    """Consumes ready groups (queue summaries) a batch option drops before the plan: recorded as
    batched without a batch, so a redelivery is dropped too; returns the state and their metrics."""
    for g in groups:
        tables.batched[g["group_id"]] = {"batch_id": None, "at_ms": now_ms, "dropped": reason}
        del tables.ready[g["group_id"]]
        del tables.queue[g["group_id"]]
    gone = sum(len(batching.trainable_members(g)) for g in groups)
    return {**state, "available": state["available"] - gone}, _drop_metrics(run, state, groups, reason, now_ms)


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
                 if state["store_failures"] and store_due(state, now_ms)), None)


def retry_pending(tables: BatcherTables) -> bool:
    """Whether any run waits to retry a failed store (the retry timer ticks only then)."""
    return any(state["store_failures"] for state in tables.state.values())


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
    batch = codec().decode(pointer, BATCH)
    run = batch["run"]
    state = tables.state[run]
    failures = state["store_failures"] + 1
    retry_at = store_retry_at(failures, now_ms, worker)
    tables.state[run] = {**state, "store_failures": failures, "retry_at_ms": retry_at}
    metric = {"run": run, "name": STORE_FAILED_METRIC, "value": 1.0, "step": state["learner_version"],
              "labels": {"batch_id": batch["batch_id"], "index": str(batch["index"]),
                         "consecutive_failures": str(failures), "retry_in_s": f"{(retry_at - now_ms) / 1000:g}",
                         "reason": reason},
              "source": "streams/batcher", "at_ms": now_ms}
    return [(topics.METRICS, STORE_FAILED_METRIC.encode(), encode_for(topics.METRICS, metric))]
