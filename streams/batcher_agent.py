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
- `batcher-state` run -> {"learner_version", "answered", "index", "ready": [group summaries]};
- `batcher-ready` group_id -> the group event as received (raw bytes), until it is batched;
- `batcher-batched` group_id -> batch id: a redelivered group that was already trained is dropped.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from schemas import topics
from schemas.codec import codec
from streams import batching
from streams.app import Out, Wiring
from streams.serde import decode_from, encode_for, raw_table, tagged_table
from streams.settings import StreamsSettings

GROUP, WEIGHTS = "group", "weight_version"


@dataclass
class BatcherTables:
    """The batcher's tables (Faust tables in the worker, plain dicts in unit tests)."""

    state: MutableMapping[str, dict[str, Any]]
    ready: MutableMapping[str, bytes]
    batched: MutableMapping[str, str]


def empty_state() -> dict[str, Any]:
    return {"learner_version": None, "answered": None, "index": 0, "ready": []}


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


def _try_cut(tables: BatcherTables, run: str, state: dict[str, Any], now_ms: int,
             settings: StreamsSettings) -> tuple[dict[str, Any], list[Out]]:
    version = credit(state)
    plan = batching.plan_batch(state["ready"], version, state["index"], settings)
    if not plan.cut:
        return state, []
    groups = [codec().decode(tables.ready[g["group_id"]], GROUP) for g in plan.groups]
    batch = batching.build_batch(run, state["index"], version, groups, settings, now_ms)
    for g in plan.groups:
        tables.batched[g["group_id"]] = batch["batch_id"]
        del tables.ready[g["group_id"]]
    state = {**state, "ready": plan.remaining, "index": state["index"] + 1, "answered": version}
    return state, [(topics.BATCHES, batch["batch_id"].encode(), encode_for(topics.BATCHES, batch))]


def on_batcher_event(tables: BatcherTables, data: bytes, now_ms: int, settings: StreamsSettings) -> list[Out]:
    """Applies a group or a weight version to its run's state; returns the batch if one is cut."""
    if codec().event_type_of(data) == WEIGHTS:
        version = codec().decode(data, WEIGHTS)
        run = version["run"]
        state = tables.state.get(run) or empty_state()
        if state["learner_version"] is None or version["version"] > state["learner_version"]:
            state = {**state, "learner_version": version["version"]}
    else:
        group = codec().decode(data, GROUP)
        run, gid = group["run"], group["group_id"]
        state = tables.state.get(run) or empty_state()
        if gid in tables.batched or any(g["group_id"] == gid for g in state["ready"]):
            return []  # a redelivered group: already ready or trained
        tables.ready[gid] = data
        state = {**state, "ready": [*state["ready"], summary(group)]}
    state, outs = _try_cut(tables, run, state, now_ms, settings)
    tables.state[run] = state
    return outs


def register(w: Wiring) -> None:
    """Declares the batcher's intake agents, its one-partition tables and the batching agent."""
    batcher_in = w.internal_topic("batcher", 1)
    tables = BatcherTables(
        state=tagged_table(w.app, "batcher-state", 1, w.topic_config),
        ready=raw_table(w.app, "batcher-ready", 1, w.topic_config),
        batched=tagged_table(w.app, "batcher-batched", 1, w.topic_config),
    )
    w.tables["batcher"] = tables

    @w.app.agent(w.raw_topic(topics.GROUPS), name="batcher-intake")
    async def groups_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                group = decode_from(topics.GROUPS, event.value)
                if not group["validation"] and w.serves(group):  # validation groups are evaluated, never trained
                    await batcher_in.send(key=group["run"].encode(), value=event.value, partition=0)
            await w.guarded(event, "batcher-intake", forward)

    @w.app.agent(w.raw_topic(topics.WEIGHTS), name="batcher-weights-intake")
    async def weights_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                version = decode_from(topics.WEIGHTS, event.value)
                if w.serves(version):
                    await batcher_in.send(key=version["run"].encode(), value=event.value, partition=0)
            await w.guarded(event, "batcher-weights-intake", forward)

    @w.app.agent(batcher_in, name="batcher")
    async def batcher(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def handle(event=event) -> None:
                await w.send(on_batcher_event(tables, event.value, w.clock(), w.settings))
            await w.guarded(event, "batcher", handle)
