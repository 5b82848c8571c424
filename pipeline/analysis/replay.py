"""Replay's I/O: read a range of a topic from Kafka as decoded records, write them as Parquet or JSONL.

Reading takes no consumer group and commits nothing, so it can run against a live run, or long
after the processes that wrote it are gone, without disturbing anyone. It snapshots every
partition's end when it starts, so it terminates even while producers keep writing. Records come
out ordered by (partition, offset). Undecodable records are counted in a `ReplayStats` and never
yielded; replay is read-only, so it does not dead-letter them (the consumers that own the topics
did that already).

Writing is deterministic: the same records give byte-identical files (Parquet: zstd, one row group
per `ROW_GROUP` rows, no write time embedded; JSONL: one object per line with sorted keys, binary
values as base64).
"""

from __future__ import annotations

import base64
import json
import os
import time
from functools import partial
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from minio.error import MinioException, S3Error

from pipeline.analysis.replay_columns import arrow_schema, flatten
from pipeline.analysis.replay_records import Bound, MissingPayload, ReplayRecord, ReplayStats, UndecodableRecord, run_of
from schemas import objectstore, topics
from schemas.codec import UndecodableEvent, codec
from schemas.settings import KafkaSettings, ObjectStoreSettings

__all__ = ["Bound", "ReplayError", "ReplayRecord", "ReplayStats", "read_run", "read_topic", "write_records",
           "SUFFIXES", "VERIFY_TOPICS"]

SUFFIXES = (".parquet", ".jsonl")
ROW_GROUP = 1000
# Everything verify reads: the run's events except engine heartbeats, which it has no check for.
VERIFY_TOPICS: tuple[str, ...] = tuple(t for t in topics.ALL_TOPICS if t != topics.ENGINES)


class ReplayError(RuntimeError):
    """The topic cannot be read: it does not exist, or the broker stopped answering."""


Fetch = Callable[[str], bytes]
"""Reads an object by its s3:// URI (claim-checked events are stored whole in the object store)."""


def store_fetch(store: ObjectStoreSettings) -> Fetch:
    """A Fetch from the object store; the client is made on the first claim check."""
    clients: list[Any] = []

    def fetch(uri: str) -> bytes:
        if not clients:
            clients.append(objectstore.client(store))
        return objectstore.get_bytes(clients[0], *objectstore.parse_uri(uri))
    return fetch


def _consumer(kafka: KafkaSettings) -> Consumer:
    # group.id is required by librdkafka but unused: partitions are assigned, nothing is committed.
    # Partitions are read one after another, so every fetch wait is paid per partition: with the
    # default 500 ms wait, a topic of many small partitions took seconds longer to read.
    return Consumer(kafka.as_confluent(**{
        "group.id": "rollstream-replay", "enable.auto.commit": False, "enable.partition.eof": True,
        "auto.offset.reset": "earliest", "fetch.wait.max.ms": 20,
        "fetch.message.max.bytes": kafka.message_max_bytes, "fetch.max.bytes": 4 * kafka.message_max_bytes}))


def _offset_at(consumer: Consumer, topic: str, partition: int, bound: Bound, low: int, high: int) -> int:
    """The offset a bound names in one partition, within [low, high]."""
    if bound.offset is not None:
        return min(max(bound.offset, low), high)
    found = consumer.offsets_for_times([TopicPartition(topic, partition, bound.timestamp_ms)], timeout=10)[0]
    return high if found.offset < 0 else min(max(found.offset, low), high)


def _ranges(consumer: Consumer, topic: str, start: Bound | None, end: Bound | None) -> dict[int, tuple[int, int]]:
    """{partition: (first offset, end offset exclusive)} as the topic stands now."""
    meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ReplayError(f"topic {topic!r} does not exist on the broker")
    ranges = {}
    for p in sorted(meta.partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        first = low if start is None else _offset_at(consumer, topic, p, start, low, high)
        last = high if end is None else _offset_at(consumer, topic, p, end, low, high)
        ranges[p] = (first, max(first, last))
    return ranges


def read_topic(kafka: KafkaSettings, topic: str, *, run: str | None = None, start: Bound | None = None,
               end: Bound | None = None, stats: ReplayStats | None = None,
               progress: Callable[[ReplayStats], None] | None = None,
               stall_timeout_s: float = 30.0, fetch: Fetch | None = None) -> Iterator[ReplayRecord]:
    """The decoded events of `topic` in [start, end) per partition, ordered by (partition, offset),
    only those of `run` when given (events that carry no run are all kept). Undecodable records
    are counted in `stats`; `progress` sees the stats after every fetch (records of other runs
    included, which a caller of a filtered replay would otherwise not see pass). A claim-checked
    event (payload_uri) is replaced by the whole event read with `fetch` and verified; one whose
    object differs counts as undecodable, one whose object no longer exists is yielded as it stands
    (items empty) and listed in `stats.missing_payloads` (without `fetch` it stays as it is). Raises
    ReplayError for a missing topic or a broker that stops answering."""
    if topic not in topics.EVENT_OF_TOPIC:
        raise ReplayError(f"unknown topic {topic!r}; topics: {', '.join(topics.ALL_TOPICS)}")
    stats = stats if stats is not None else ReplayStats()
    event_type = topics.EVENT_OF_TOPIC[topic]
    consumer = _consumer(kafka)
    try:
        ranges = _ranges(consumer, topic, start, end)
        stats.planned += sum(e - s for s, e in ranges.values())
        for partition, (first, stop) in ranges.items():
            for msg in _messages(consumer, topic, partition, first, stop, stats, progress, stall_timeout_s):
                record = _decode(msg, event_type, stats)
                if record is None:
                    continue
                owner = run_of(topic, record.value)
                if run is not None and owner is not None and owner != run:
                    stats.other_runs += 1
                    continue
                if fetch is not None:
                    record = _resolve(record, event_type, fetch, stats)
                    if record is None:
                        continue
                stats.kept += 1
                yield record
    except KafkaException as e:
        raise ReplayError(f"cannot read {topic!r} from {kafka.bootstrap_servers}: {e}") from None
    finally:
        consumer.close()


def _messages(consumer: Consumer, topic: str, partition: int, first: int, stop: int, stats: ReplayStats,
              progress: Callable[[ReplayStats], None] | None, stall_timeout_s: float) -> Iterator[Any]:
    """The messages of one partition from `first` up to (excluding) `stop`. One partition at a time
    is what makes a replay ordered by (partition, offset)."""
    if first >= stop:
        return
    consumer.assign([TopicPartition(topic, partition, first)])
    last_progress = time.monotonic()
    while True:
        messages = consumer.consume(500, 0.1)
        if not messages and time.monotonic() - last_progress > stall_timeout_s:
            raise ReplayError(f"{topic}[{partition}]: no records for {stall_timeout_s:g} s before offset {stop}")
        for msg in messages:
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return  # compaction or retention left nothing more before the end
                raise ReplayError(f"{topic}[{partition}]: {msg.error()}")
            if msg.offset() >= stop:
                return
            last_progress = time.monotonic()
            stats.read += 1
            yield msg
            if msg.offset() + 1 >= stop:
                return
        if progress is not None:
            progress(stats)


def _decode(msg: Any, event_type: str, stats: ReplayStats) -> ReplayRecord | None:
    try:
        value = codec().decode(msg.value(), event_type)
    except UndecodableEvent as e:
        stats.add_undecodable(UndecodableRecord(msg.topic(), msg.partition(), msg.offset(), e.reason))
        return None
    return ReplayRecord(msg.topic(), msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(), value)


def _resolve(record: ReplayRecord, event_type: str, fetch: Fetch, stats: ReplayStats) -> ReplayRecord | None:
    """The record with its claim check resolved; as it stands (no items) when the stored object no
    longer exists, which happens to every batch older than the payload bucket's expiration."""
    if record.value.get("payload_uri") is None:
        return record
    try:
        value = objectstore.resolve_claim_check(record.value, event_type, fetch)
    except S3Error as e:
        if e.code != "NoSuchKey":
            stats.add_undecodable(UndecodableRecord(record.topic, record.partition, record.offset,
                                                    f"claim check {record.value['payload_uri']}: {e}"))
            return None
        stats.missing_payloads.append(MissingPayload(record.topic, record.partition, record.offset,
                                                     record.value["batch_id"], record.value["payload_uri"]))
        return record
    except (objectstore.PayloadMismatch, UndecodableEvent, MinioException) as e:
        stats.add_undecodable(UndecodableRecord(record.topic, record.partition, record.offset,
                                                f"claim check {record.value['payload_uri']}: {e}"))
        return None
    return ReplayRecord(record.topic, record.partition, record.offset, record.timestamp_ms, record.key, value)


def read_run(kafka: KafkaSettings, run: str, topics: Sequence[str] = VERIFY_TOPICS, *, start: Bound | None = None,
             stats: ReplayStats | None = None, progress: Callable[[str, ReplayStats], None] | None = None,
             fetch: Fetch | None = None) -> dict[str, list[ReplayRecord]]:
    """Every event of `run` on each of `topics` (all of dlq, which carries no run), from
    `start` (the run's start time spares reading older runs) or the beginning, claim checks
    resolved with `fetch`; `progress` sees the topic being read and the stats so far."""
    return {t: list(read_topic(kafka, t, run=run, start=start, stats=stats,
                               progress=None if progress is None else partial(progress, t), fetch=fetch))
            for t in topics}


# -- writing -----------------------------------------------------------------------------------

class _Writer(Protocol):
    def write(self, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


class _ParquetWriter:
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._schema = schema
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")

    def write(self, rows: list[dict[str, Any]]) -> None:
        self._writer.write_table(pa.Table.from_pylist(rows, schema=self._schema))

    def close(self) -> None:
        self._writer.close()


def _json_value(value: Any) -> str:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _JsonlWriter:
    def __init__(self, path: Path) -> None:
        self._file = path.open("w", encoding="utf-8")

    def write(self, rows: list[dict[str, Any]]) -> None:
        self._file.writelines(json.dumps(r, sort_keys=True, default=_json_value) + "\n" for r in rows)

    def close(self) -> None:
        self._file.close()


def _open(path: Path, topic: str, final_suffix: str) -> _Writer:
    return _ParquetWriter(path, arrow_schema(topic)) if final_suffix == ".parquet" else _JsonlWriter(path)


def write_records(records: Iterable[ReplayRecord], topic: str, paths: Sequence[Path]) -> int:
    """Writes the records' flat rows to every path (format by suffix); returns the rows written.
    Each file appears whole or not at all: it is written beside and renamed at the end."""
    for path in paths:
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: write .parquet or .jsonl")
    partial = [p.with_name(f".{p.name}.partial") for p in paths]
    writers = [_open(tmp, topic, p.suffix) for tmp, p in zip(partial, paths)]
    rows: list[dict[str, Any]] = []
    count = 0
    try:
        for record in records:
            rows.append(flatten(record))
            if len(rows) == ROW_GROUP:
                for w in writers:
                    w.write(rows)
                count, rows = count + len(rows), []
        if rows:
            for w in writers:
                w.write(rows)
            count += len(rows)
    except BaseException:
        for w, tmp in zip(writers, partial):
            w.close()
            tmp.unlink(missing_ok=True)
        raise
    for w, tmp, path in zip(writers, partial, paths):
        w.close()
        os.replace(tmp, path)
    return count
