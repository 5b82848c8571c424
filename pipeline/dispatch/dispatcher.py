"""The dispatcher process: feeds tasks.requested for one run, within the in-flight bound.

The planning is pipeline/dispatch/logic.py; this module does the I/O around it:
- on start it reads tasks.requested back (every partition, up to its end) and keeps the run's
  events, so the cursor and the validation rounds already dispatched are rebuilt from the log
  itself: a restart neither re-dispatches nor skips a sample;
- while running it follows `batches`, `weights`, `metrics` and `alerts` (from their beginning, the
  run's events only): a batch's groups count as trained once the learner has published a version
  newer than the batch's credit_version, and a streams/group_dropped metric releases its group (a
  dropped group never reaches a batch and would otherwise hold credit forever). A reader that stops
  reading a partition while events wait there (a broker restart can leave its consumer so) is
  replaced by a fresh one from where it stopped (ProgressReader, schemas/assigned_reader.py);
- an alert whose rule's action is pause (or stop) holds it: it sends nothing more, validation rounds
  included, while the work in flight finishes, until a resume (`rollstream alerts resume`) is read
  after it (streams/alerts.py RunHold). Reading `alerts` from its beginning, a restarted dispatcher is
  still paused;
- every request of a group is acknowledged by the broker (flush) before the next plan, so what
  the log holds is what was dispatched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client import Counter, Gauge

from pipeline.dispatch import logic
from schemas import topics
from schemas.bus import EventProducer, now_ms
from schemas.codec import UndecodableEvent, codec
from schemas.assigned_reader import STUCK_CHECK_S, AssignedReader
from schemas.prometheus import serve_metrics
from schemas.settings import KafkaSettings
from streams.alerts import RunHold

log = logging.getLogger("rollstream.dispatch")

# What the dispatcher's Prometheus endpoint shows (schemas/prometheus.py).
TASKS_SENT = Counter("rollstream_dispatcher_tasks_sent", "Task requests sent to tasks.requested (one per member), "
                     "training or validation.", ["kind"], registry=None)
GROUPS_IN_FLIGHT = Gauge("rollstream_dispatcher_groups_in_flight", "Training groups dispatched and neither trained "
                         "nor dropped yet.", registry=None)
IN_FLIGHT_BOUND = Gauge("rollstream_dispatcher_in_flight_bound", "The most training groups in flight at once.",
                        registry=None)
PAUSED = Gauge("rollstream_dispatcher_paused", "1 while an alert (action pause or stop) holds the dispatcher, "
               "else 0.", registry=None)
PROMETHEUS = (TASKS_SENT, GROUPS_IN_FLIGHT, IN_FLIGHT_BOUND, PAUSED)


@dataclass
class Dispatched:
    """What tasks.requested already holds for the run."""

    slots: list[logic.Slot] = field(default_factory=list)
    group_ids: set[str] = field(default_factory=set)
    validation_rounds: set[int] = field(default_factory=set)


@dataclass
class Progress:
    """What the learner, the aggregator and the alerts have reported for the run."""

    learner_version: int = 0
    batches: dict[str, tuple[int, list[str]]] = field(default_factory=dict)  # batch_id -> (credit, group ids)
    released: set[str] = field(default_factory=set)
    skipped_batches: set[str] = field(default_factory=set)
    hold: RunHold = field(default_factory=RunHold)

    def trained(self) -> set[str]:
        """Groups of batches the learner has answered with a newer weight version, or consumed
        without a step (a batch with no action tokens)."""
        return {g for batch_id, (credit, gids) in self.batches.items()
                if self.learner_version > credit or batch_id in self.skipped_batches for g in gids}


def _consumer(kafka: KafkaSettings, name: str) -> tuple[Consumer, dict[tuple[str, int], int]]:
    """A group-less consumer of every partition of topic `name` from the beginning, and the ends of the
    partitions that hold events."""
    consumer = Consumer(kafka.as_confluent(**{
        "group.id": "rollstream-dispatch-reader", "enable.auto.commit": False,
        "fetch.message.max.bytes": kafka.message_max_bytes}))
    parts, ends = [], {}
    try:
        for p in consumer.list_topics(name, timeout=10).topics[name].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)
            parts.append(TopicPartition(name, p, low))
            if high > low:
                ends[(name, p)] = high
        consumer.assign(parts)
    except KafkaException:
        consumer.close()
        raise
    return consumer, ends


def _decoded(msg: Any) -> dict[str, Any] | None:
    if msg.error() is not None:
        return None
    try:
        return codec().decode(msg.value(), topics.EVENT_OF_TOPIC[msg.topic()])
    except UndecodableEvent:
        return None  # dead-lettered by the streams app, which owns these topics' consumption


def _read_to_end(kafka: KafkaSettings, name: str, run: str, timeout_s: float) -> Iterator[dict[str, Any]]:
    """The run's events on topic `name`, read up to the end each partition had."""
    consumer, ends = _consumer(kafka, name)
    deadline = time.monotonic() + timeout_s
    try:
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not read to its end within {timeout_s:g} s")
            for msg in consumer.consume(1000, 0.5):
                key = (msg.topic(), msg.partition())
                if msg.error() is None and key in ends and msg.offset() + 1 >= ends[key]:
                    del ends[key]
                r = _decoded(msg)
                if r is not None and r["run"] == run:
                    yield r
    finally:
        consumer.close()


def read_dispatched(kafka: KafkaSettings, run: str, sources: tuple[logic.TaskSource, ...],
                    timeout_s: float = 60.0) -> Dispatched:
    """The run's requests already in tasks.requested, read up to the end each partition had."""
    out = Dispatched()
    for r in _read_to_end(kafka, topics.TASKS_REQUESTED, run, timeout_s):
        if r["group_id"] in out.group_ids:
            continue
        out.group_ids.add(r["group_id"])
        if r["validation"]:
            out.validation_rounds.add(r["epoch"])
        else:
            out.slots.append(logic.Slot(r["task"], r["split"], r["sample_index"], r["epoch"]))
    return out


def read_hold(kafka: KafkaSettings, run: str, timeout_s: float = 60.0) -> RunHold:
    """What the run's alerts so far say (paused, stopped), read to the topic's end before anything is
    dispatched: a dispatcher restarted while its run is paused must not send a task first."""
    hold = RunHold()
    for alert in _read_to_end(kafka, topics.ALERTS, run, timeout_s):
        hold.apply(alert)
    return hold


PROGRESS_TOPICS = (topics.BATCHES, topics.WEIGHTS, topics.METRICS, topics.ALERTS)


class ProgressReader:
    """Follows batches, weights, metrics and alerts for one run, from the topics' beginning. A reader that
    stops reading after a broker restart is renewed (schemas/assigned_reader.py): without it the
    dispatcher saw no trained batch, held its in-flight bound full and the run stood still."""

    def __init__(self, kafka: KafkaSettings, run: str, hold: RunHold | None = None, *,
                 check_s: float = STUCK_CHECK_S) -> None:
        self.run = run
        self.progress = Progress(hold=hold or RunHold())  # alerts read again from the start count once (by id)
        self._reader = AssignedReader(kafka, PROGRESS_TOPICS, f"the progress reader of run {run}", check_s=check_s,
                                      config={"group.id": "rollstream-dispatch-reader", "enable.auto.commit": False,
                                              "fetch.message.max.bytes": kafka.message_max_bytes})

    @property
    def renewals(self) -> int:
        return self._reader.renewals

    def poll(self, timeout: float) -> Progress:
        for msg in self._reader.consume(1000, timeout):
            e = _decoded(msg)
            if e is None or e["run"] != self.run:
                continue
            if msg.topic() == topics.BATCHES:
                self.progress.batches[e["batch_id"]] = (e["credit_version"], list(e["group_ids"]))
            elif msg.topic() == topics.WEIGHTS:
                self.progress.learner_version = max(self.progress.learner_version, e["version"])
            elif msg.topic() == topics.ALERTS:
                self.progress.hold.apply(e)
            elif e["name"] == topics.GROUP_DROPPED_METRIC and "group_id" in e["labels"]:
                self.progress.released.add(e["labels"]["group_id"])
            elif e["name"] == topics.BATCH_SKIPPED_METRIC and "batch_id" in e["labels"]:
                self.progress.skipped_batches.add(e["labels"]["batch_id"])
        return self.progress

    def renew(self, why: str = "asked to") -> None:
        self._reader.renew(why)

    def close(self) -> None:
        self._reader.close()


def _send(producer: EventProducer, events: list[dict[str, Any]]) -> None:
    for e in events:
        producer.send(topics.TASKS_REQUESTED, e, key=e["group_id"])
    producer.flush()  # durable before the dispatcher counts it as dispatched
    for e in events:
        TASKS_SENT.labels("validation" if e["validation"] else "train").inc()


def run_dispatcher(kafka: KafkaSettings, run: str, settings: logic.DispatcherSettings, max_groups: int, *,
                   poll_s: float = 1.0, clock: Callable[[], int] = now_ms,
                   should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Dispatches training groups until the run holds max_groups of them (validation rounds as
    they fall due meanwhile); returns a summary. Resumes from what tasks.requested holds."""
    serve_metrics(settings.metrics_port, "dispatcher", PROMETHEUS, host=settings.metrics_host)
    IN_FLIGHT_BOUND.set(settings.in_flight_bound)
    done = read_dispatched(kafka, run, settings.sources)
    cursor = logic.cursor_from_dispatched(settings.sources, done.slots, settings.seed)
    train_ids = {logic.group_id(run, s.task, s.split, s.sample_index, s.epoch) for s in done.slots}
    summary = {"run": run, "resumed_groups": len(train_ids), "resumed_at_position": cursor.position,
               "dispatched_groups": 0, "validation_rounds": []}
    log.info("run %s: %d training groups already dispatched, resuming at position %d",
             run, len(train_ids), cursor.position)
    progress_reader = ProgressReader(kafka, run, read_hold(kafka, run))
    producer = EventProducer(kafka, client_id=f"dispatch-{run}")
    held_by: str | None = None
    try:
        while not should_stop():
            progress = progress_reader.poll(poll_s)
            hold = progress.hold
            if hold.held_by != held_by:
                held_by = hold.held_by
                PAUSED.set(held_by is not None)
                log.info("run %s: %s", run, "dispatching again" if held_by is None else
                         f"stopped by alert {held_by}" if hold.stopped_by else
                         f"paused by alert {held_by} (rollstream alerts resume --run {run} resumes it)")
            if held_by is not None:
                continue  # what is in flight finishes; nothing new goes out
            version = progress.learner_version
            round_ = logic.validation_round_due(version, done.validation_rounds, settings)
            if round_ is not None:
                _send(producer, logic.plan_validation(run, settings, round_, version, clock()))
                done.validation_rounds.add(round_)
                summary["validation_rounds"].append(round_)
                log.info("run %s: validation round %d dispatched at version %d", run, round_, version)
            remaining = max_groups - len(train_ids)
            if remaining <= 0:
                break
            in_flight = logic.in_flight(train_ids, progress.trained(), progress.released)
            GROUPS_IN_FLIGHT.set(in_flight)
            budget = min(logic.dispatch_budget(settings, in_flight), remaining)
            slots, cursor = logic.next_slots(settings.sources, cursor, budget, settings.seed)
            events = [e for s in slots for e in logic.requests_for(run, s, settings.group_size, False, version, clock())]
            if events:
                _send(producer, events)
                train_ids |= {e["group_id"] for e in events}
                summary["dispatched_groups"] += len(slots)
                log.info("run %s: dispatched %d groups (%d in flight before)", run, len(slots), in_flight)
    finally:
        progress_reader.close()
        producer.flush()
    summary["total_groups"] = len(train_ids)
    summary["held_by_alert"] = held_by
    return summary
