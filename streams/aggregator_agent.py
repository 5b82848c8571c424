"""Group aggregator: trajectories -> groups (GRPO), with dedup, masking, timeouts and staleness.

The decisions are aggregation.add_member / decide; this module keeps two tables, both
partitioned like `trajectories` (keyed by group_id, so a group's members meet in one partition):

- `agg-groups`  group_id -> the group's state (aggregation's dict) with the members' trajectories
  as the group carries them (token arrays referred to, not held), plus "partition" (which
  partition owns it, for the sweep);
- `agg-partition` "p<partition>" -> {"versions": {run: learner version}, "stats": {run: counters}}.

The aggregator carries each trajectory on without its token arrays, with arrays_uri referring to
the `trajectories` event they stay in (`carried`, schemas/eventref.py): groups and batches
carry kilobytes per trajectory, and the learner reads the arrays from that event. Counting action
tokens needs no arrays (the turns' lengths count them).

A timer broadcasts a tick into every partition every sweep_interval_s; processing it sweeps that
partition's open groups (timeouts, staleness) and deletes expired tombstones, since a group whose
last member is lost receives no event of its own. Each dropped group is reported as a `metric`
event named streams/group_dropped (labels group_id, reason) so the dispatcher releases its credit.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from schemas import eventref, topics
from schemas.codec import codec
from streams import aggregation
from streams.app import Wiring
from streams.events import Out, decode_from, encode_for
from streams.serde import tagged_table
from streams.settings import StreamsSettings

TICK = b"tick"
TRAJECTORY, WEIGHTS = "trajectory", "weight_version"
_ARRAYS = ("input_ids", "loss_mask", "rollout_logprobs")

# What the worker's Prometheus endpoint shows of the aggregator, over the partitions this worker holds.
OPEN_GROUPS = Gauge("rollstream_streams_open_groups", "Groups waiting for members.", ["run"], registry=None)
GROUP_COUNTERS = Gauge("rollstream_streams_groups", "The aggregator's counters: groups emitted and dropped (by "
                       "completion and reason), masked members, duplicates.", ["run", "counter"], registry=None)
STALENESS = Gauge("rollstream_streams_group_staleness", "Groups emitted, by staleness: the learner's version "
                  "minus the oldest version among the group's turns.", ["run", "versions"], registry=None)
PROMETHEUS = (OPEN_GROUPS, GROUP_COUNTERS, STALENESS)


@dataclass
class AggregatorTables:
    """The aggregator's tables (Faust tables in the worker, plain dicts in unit tests)."""

    groups: MutableMapping[str, dict[str, Any]]
    partitions: MutableMapping[str, dict[str, Any]]


def without_arrays(trajectory: dict[str, Any]) -> dict[str, Any]:
    """The trajectory as the group state holds it: everything but the packed token arrays."""
    return {**trajectory, **{k: b"" for k in _ARRAYS}}


def carried(trajectory: dict[str, Any], topic: str, partition: int, offset: int) -> dict[str, Any]:
    """The trajectory as the aggregator carries it on (schemas/eventref.py): its arrays left in the
    `trajectories` event it was read from, arrays_uri pointing there. One whose arrays are already
    elsewhere (an object store key) goes on as it came."""
    if trajectory["arrays_uri"] is not None:
        return trajectory
    return {**without_arrays(trajectory), "arrays_uri": eventref.uri(topic, partition, offset)}


def by_reference(trajectory: dict[str, Any], data: bytes, topic: str, partition: int, offset: int) -> bytes:
    """The encoded event of `carried` (`data` itself when it goes on as it came)."""
    if trajectory["arrays_uri"] is not None:
        return data
    return codec().encode(TRAJECTORY, carried(trajectory, topic, partition, offset))


def _partition_state(tables: AggregatorTables, partition: int) -> dict[str, Any]:
    return tables.partitions.get(f"p{partition}") or {"versions": {}, "stats": {}}


def _record(tables: AggregatorTables, partition: int, run: str, counts: dict[str, int],
            extra: dict[str, dict[str, int]] | None = None) -> None:
    """Adds counts (and histogram entries) to the run's counters of this partition."""
    part = _partition_state(tables, partition)
    stats = part["stats"].get(run, {"counters": {}, "staleness": {}, "latency_ms": {}})
    stats = {**stats, "counters": aggregation.tally(stats["counters"], counts)}
    for hist, entries in (extra or {}).items():
        stats[hist] = aggregation.tally(stats[hist], entries)
    tables.partitions[f"p{partition}"] = {**part, "stats": {**part["stats"], run: stats}}


def _latency_bucket(ms: int) -> str:
    """Power-of-two millisecond buckets ("<=1", "<=2", "<=4", ...) for the latency histograms."""
    bound = 1
    while bound < ms:
        bound *= 2
    return f"<={bound}"


def _close(tables: AggregatorTables, before: dict[str, Any], decision: aggregation.Decision, partition: int,
           learner_version: int, now_ms: int) -> list[Out]:
    """Sends what a closing decision produces and writes the tombstone (members freed)."""
    gid, run = before["group_id"], before["run"]
    outs: list[Out] = []
    extra: dict[str, dict[str, int]] = {}
    if decision.action == "emit":
        group = decision.group
        outs.append((topics.GROUPS, gid.encode(), encode_for(topics.GROUPS, group)))
        extra = {"latency_ms": {"first:" + _latency_bucket(now_ms - group["first_arrival_ms"]): 1,
                                "last:" + _latency_bucket(now_ms - group["last_arrival_ms"]): 1}}
        if group["min_weight_version"] >= 0:
            extra["staleness"] = {str(learner_version - group["min_weight_version"]): 1}
    else:
        metric = {"run": run, "name": topics.GROUP_DROPPED_METRIC, "value": 1.0, "step": learner_version,
                  "labels": {"group_id": gid, "reason": decision.reason, "task": before["task"]},
                  "source": "streams/aggregator", "at_ms": now_ms}
        outs.append((topics.METRICS, topics.GROUP_DROPPED_METRIC.encode(), encode_for(topics.METRICS, metric)))
    tables.groups[gid] = {**decision.state, "partition": partition}
    _record(tables, partition, run, decision.counts, extra)
    return outs


def on_trajectory(tables: AggregatorTables, trajectory: dict[str, Any], partition: int, now_ms: int,
                  settings: StreamsSettings) -> list[Out]:
    """Offers one trajectory, as its group will carry it (`carried`), to its group; returns the
    group or drop metric if it closes now. Raises aggregation.InvalidTrajectory for a member that
    cannot belong to its group."""
    gid = trajectory["group_id"]
    added = aggregation.add_member(tables.groups.get(gid), trajectory, now_ms)
    if added.outcome != "added":
        _record(tables, partition, trajectory["run"], added.counts)
        return []
    state = {**added.state, "partition": partition}
    learner_version = _partition_state(tables, partition)["versions"].get(state["run"], 0)
    decision = aggregation.decide(state, now_ms, learner_version, settings)
    # "added" is not counted: one more changelog write per trajectory for a figure that the
    # metrics job already has (trajectories per task)
    if decision.action == "wait":
        tables.groups[gid] = state
        return []
    return _close(tables, state, decision, partition, learner_version, now_ms)


def on_weights(tables: AggregatorTables, data: bytes, partition: int) -> None:
    """Keeps the learner's latest version per run (staleness is checked against it)."""
    version = codec().decode(data, WEIGHTS)
    part = _partition_state(tables, partition)
    if version["version"] > part["versions"].get(version["run"], 0):
        tables.partitions[f"p{partition}"] = {**part, "versions": {**part["versions"], version["run"]: version["version"]}}


def on_tick(tables: AggregatorTables, partition: int, now_ms: int, settings: StreamsSettings) -> list[Out]:
    """Sweeps this partition's groups: closes the due ones, deletes expired tombstones."""
    mine = {gid: s for gid, s in list(tables.groups.items()) if s.get("partition") == partition}
    for gid in aggregation.expired_tombstones(mine, now_ms, settings):
        del tables.groups[gid]
    versions = _partition_state(tables, partition)["versions"]
    outs: list[Out] = []
    for gid, state in mine.items():
        if state["closed"] is not None:
            continue
        learner_version = versions.get(state["run"], 0)
        decision = aggregation.decide(state, now_ms, learner_version, settings)
        if decision.action != "wait":
            outs += _close(tables, state, decision, partition, learner_version, now_ms)
    return outs


def local_state(tables: AggregatorTables) -> dict[str, dict[str, Any]]:
    """Per run, over the partitions in these tables: groups still open, and the counters and staleness
    histogram of the groups closed (what the Prometheus gauges show)."""
    runs: dict[str, dict[str, Any]] = {}

    def held(run: str) -> dict[str, Any]:
        return runs.setdefault(run, {"open": 0, "counters": {}, "staleness": {}})

    for state in tables.groups.values():
        if state["closed"] is None:
            held(state["run"])["open"] += 1
    for part in tables.partitions.values():
        for run, stats in part["stats"].items():
            h = held(run)
            h["counters"] = aggregation.tally(h["counters"], stats["counters"])
            h["staleness"] = aggregation.tally(h["staleness"], stats.get("staleness", {}))
    return runs


def export(runs: dict[str, dict[str, Any]]) -> None:
    """Sets the Prometheus gauges to `local_state`."""
    for run, s in runs.items():
        OPEN_GROUPS.labels(run).set(s["open"])
        for counter, n in s["counters"].items():
            GROUP_COUNTERS.labels(run, counter).set(n)
        for versions, n in s["staleness"].items():
            STALENESS.labels(run, versions).set(n)


def register(w: Wiring) -> None:
    """Declares the aggregator's tables, the weights intake, the sweep timer and the agent on the app."""
    parts = w.worker.partitions
    source, control = w.with_control(topics.TRAJECTORIES, "aggregator")
    tables = AggregatorTables(
        groups=tagged_table(w.app, "agg-groups", parts, w.topic_config),
        partitions=tagged_table(w.app, "agg-partition", parts, w.topic_config),
    )
    w.tables["aggregator"] = tables

    w.control_intake(topics.WEIGHTS, "aggregator-weights-intake", control, parts, w.served_version)

    @w.app.timer(w.worker.sweep_interval_s, name="aggregator-sweep")
    async def sweep() -> None:
        await w.broadcast(control, parts, None, TICK)
        export(local_state(tables))

    @w.app.agent(source, name="aggregator")
    async def aggregator(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def handle(event=event) -> None:
                msg = event.message
                if msg.topic == topics.TRAJECTORIES:
                    trajectory = decode_from(topics.TRAJECTORIES, event.value)
                    if w.serves(trajectory):
                        reference = carried(trajectory, msg.topic, msg.partition, msg.offset)
                        await w.send(on_trajectory(tables, reference, msg.partition, w.clock(), w.settings))
                elif event.value == TICK:
                    await w.send(on_tick(tables, msg.partition, w.clock(), w.settings))
                else:
                    on_weights(tables, event.value, msg.partition)
            await w.guarded(event, "aggregator", handle)
