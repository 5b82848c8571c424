"""`rollstream tensorboard`'s I/O: a run's `metrics` events from Kafka, written as TensorBoard scalars
(pipeline/analysis/tensorboard_scalars.py says which) into event files, live.

Reading takes no consumer group and commits nothing, like replay. It starts at every partition's
beginning (the run's history, then what follows) or at its end (only what arrives from then on).
The history, up to the ends the topic had at the start, is read whole and written in the order it
was measured (the partitions are not read in that order, and a streams metric's step is the
learner's measured before it); later events are written in that order too, within REORDER_S of
their arrival, and reach the files every FLUSH_S. Written from the beginning, a run's scalars
replace the event files an earlier export left in the folder, so TensorBoard does not show every
point twice.

Event files are written with tensorboardX (no TensorFlow, no torch); `tensorboard --logdir DIR`
reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from pipeline.analysis.tensorboard_scalars import RunState, in_time_order, scalars
from schemas import topics
from schemas.codec import UndecodableEvent, codec
from schemas.eventref import transient_error
from schemas.settings import KafkaSettings

FLUSH_S = 2.0
"""How often written scalars reach the event files."""
REORDER_S = 1.0
"""How long an event arriving live waits for those measured before it that come from other partitions: the
events read meanwhile are written together, in the order measured. A live TensorBoard lags by this and FLUSH_S."""
EVENT_FILES = "events.out.tfevents.*"


class TensorboardError(RuntimeError):
    """`metrics` cannot be read: it does not exist, or the broker answers with an error."""


@dataclass
class ExportStats:
    logdir: str
    events: int = 0
    """Events of the run read."""
    scalars: int = 0
    tags: set[str] = field(default_factory=set)
    other_runs: int = 0
    undecodable: int = 0

    def summary(self, run: str) -> dict[str, Any]:
        return {"run": run, "logdir": self.logdir, "events": self.events, "scalars": self.scalars,
                "tags": len(self.tags), "other_runs": self.other_runs, "undecodable": self.undecodable}


class MetricsReader:
    """The run's events on `metrics`, from every partition's beginning or its end."""

    def __init__(self, kafka: KafkaSettings, run: str, *, from_beginning: bool) -> None:
        self.run = run
        # group.id is required by librdkafka but unused: partitions are assigned, nothing is committed.
        self._consumer = Consumer(kafka.as_confluent(**{
            "group.id": "rollstream-tensorboard", "enable.auto.commit": False, "enable.partition.eof": True,
            "auto.offset.reset": "earliest", "fetch.message.max.bytes": kafka.message_max_bytes}))
        meta = self._consumer.list_topics(topics.METRICS, timeout=10).topics.get(topics.METRICS)
        if meta is None or meta.error is not None or not meta.partitions:
            self._consumer.close()
            raise TensorboardError(f"topic {topics.METRICS!r} does not exist on {kafka.bootstrap_servers}")
        starts: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        for p in sorted(meta.partitions):
            low, high = self._consumer.get_watermark_offsets(TopicPartition(topics.METRICS, p), timeout=10)
            starts[p], self._ends[p] = (low if from_beginning else high), high
        self._behind = {p for p, start in starts.items() if start < self._ends[p]}
        self._consumer.assign([TopicPartition(topics.METRICS, p, offset) for p, offset in starts.items()])

    @property
    def caught_up(self) -> bool:
        """Whether every partition has been read up to its end at the start."""
        return not self._behind

    def poll(self, timeout_s: float, stats: ExportStats) -> list[dict[str, Any]]:
        """The run's events that arrived (waiting up to `timeout_s`); counts the others in `stats`."""
        events = []
        for msg in self._consumer.consume(500, timeout_s):
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self._behind.discard(msg.partition())
                elif not transient_error(error):  # a broker restarting: the client reconnects by itself
                    raise TensorboardError(f"reading {topics.METRICS}[{msg.partition()}]: {error}")
                continue
            if msg.offset() + 1 >= self._ends[msg.partition()]:
                self._behind.discard(msg.partition())
            try:
                value = codec().decode(msg.value(), topics.EVENT_OF_TOPIC[topics.METRICS])
            except UndecodableEvent:
                stats.undecodable += 1  # read-only: the consumers that own the topic dead-letter it
                continue
            if value["run"] != self.run:
                stats.other_runs += 1
                continue
            events.append(value)
        return events

    def close(self) -> None:
        self._consumer.close()


def export_run(kafka: KafkaSettings, run: str, logdir: Path, *, from_beginning: bool = True,
               until_idle_s: float | None = None, should_stop: Callable[[], bool] = lambda: False,
               progress: Callable[[str], None] = lambda line: None,
               clock: Callable[[], float] = time.monotonic) -> ExportStats:
    """Writes the run's metrics as scalars under `logdir` until `until_idle_s` pass without an event of
    the run once its history is written (None: never), or `should_stop()`; returns what it did."""
    from tensorboardX import SummaryWriter  # only here: every other command starts without it

    reader = MetricsReader(kafka, run, from_beginning=from_beginning)
    logdir.mkdir(parents=True, exist_ok=True)
    if from_beginning:
        for old in logdir.glob(EVENT_FILES):
            old.unlink()
    writer = SummaryWriter(str(logdir), flush_secs=FLUSH_S)
    stats, state = ExportStats(str(logdir)), RunState()
    pending: list[dict[str, Any]] = []  # read, not yet written: the history, then what arrived in REORDER_S
    pending_since = 0.0
    following = False

    def write_pending() -> None:
        for event in in_time_order(pending):
            for s in scalars(event, state):
                writer.add_scalar(s.tag, s.value, s.step, walltime=s.wall_time_s)
                stats.scalars += 1
                stats.tags.add(s.tag)
        pending.clear()

    try:
        last_event_at = clock()
        while not should_stop():
            events = reader.poll(0.5, stats)
            if events:
                stats.events += len(events)
                pending_since = pending_since if pending else clock()
                pending += events
                last_event_at = clock()
            if not following:
                if not reader.caught_up:
                    continue
                write_pending()
                following, last_event_at = True, clock()
                progress(f"history of run {run}: {stats.events} events, {stats.scalars} scalars in {logdir}; "
                         "following")
            elif pending and clock() - pending_since >= REORDER_S:
                write_pending()
            elif not pending and until_idle_s is not None and clock() - last_event_at >= until_idle_s:
                progress(f"no event of run {run} for {until_idle_s:g} s: stopping")
                break
    finally:
        write_pending()  # what was read before a stop, the history too when it was not read whole
        writer.close()
        reader.close()
    return stats
