"""The event codec: single-object encoding, schema evolution, and clear errors for bad bytes."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import avro.io
import avro.schema
import pytest
import yaml

from schemas import samples, topics
from schemas.codec import EVENT_TYPES, HISTORY_DIR, MAGIC, SCHEMA_DIR, EventCodec, InvalidEvent, UndecodableEvent, codec

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_every_event_type_round_trips_through_the_codec(event_type):
    value = samples.example(event_type)
    data = codec().encode(event_type, value)
    assert data[:2] == MAGIC
    assert data[2:10] == codec().fingerprint(event_type)
    assert codec().decode(data, event_type) == value
    assert codec().decode(data) == value
    assert codec().event_type_of(data) == event_type


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_apache_avro_decodes_our_encoding_and_agrees_on_the_fingerprint(event_type):
    schema = avro.schema.parse(json.dumps(codec().schema(event_type)))
    assert schema.fingerprint("CRC-64-AVRO") == codec().fingerprint(event_type)
    data = codec().encode(event_type, samples.example(event_type))
    decoded = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    assert decoded == samples.example(event_type)


def test_apache_avro_encoding_decodes_with_our_codec():
    schema = avro.schema.parse(json.dumps(codec().schema("trajectory")))
    buf = io.BytesIO()
    avro.io.DatumWriter(schema).write(samples.trajectory(), avro.io.BinaryEncoder(buf))
    data = MAGIC + schema.fingerprint("CRC-64-AVRO") + buf.getvalue()
    assert codec().decode(data, "trajectory") == samples.trajectory()


def test_event_written_with_the_previous_trajectory_schema_still_decodes():
    old = {k: v for k, v in samples.trajectory().items() if k not in ("score", "metrics")}
    data = codec().encode("trajectory", old, schema_version=1)
    assert data[2:10] != codec().fingerprint("trajectory")
    assert codec().decode(data, "trajectory") == {**old, "score": None, "metrics": {}}


def test_heartbeat_written_before_heartbeats_carried_a_run_decodes_with_an_empty_run():
    old = {k: v for k, v in samples.engine_heartbeat().items() if k not in ("run", "busy", "busy_for_ms")}
    data = codec().encode("engine_heartbeat", old, schema_version=1)
    assert codec().decode(data, "engine_heartbeat") == {**old, "run": "", "busy": "", "busy_for_ms": 0}


def test_heartbeat_written_before_heartbeats_said_the_engine_was_busy_decodes_as_not_busy():
    old = {k: v for k, v in samples.engine_heartbeat().items() if k not in ("busy", "busy_for_ms")}
    data = codec().encode("engine_heartbeat", old, schema_version=2)
    assert codec().decode(data, "engine_heartbeat") == {**old, "busy": "", "busy_for_ms": 0}


def test_every_history_schema_differs_from_the_current_one_only_by_added_fields_with_defaults():
    for path in HISTORY_DIR.glob("*.avsc"):
        event_type = path.name.split(".")[0]
        old = {f["name"] for f in json.loads(path.read_text())["fields"]}
        current = json.loads((SCHEMA_DIR / f"{event_type}.avsc").read_text())["fields"]
        assert old <= {f["name"] for f in current}, f"{path.name}: fields were removed"
        assert all("default" in f for f in current if f["name"] not in old), f"{path.name}: a new field lacks a default"


@pytest.mark.parametrize("data,reason", [
    (None, "empty value"),
    (b"", "not an Avro single-object encoding"),
    (b"{\"json\": true}", "not an Avro single-object encoding"),
    (MAGIC + b"\x00" * 8 + b"\x02", "unknown schema fingerprint"),
])
def test_bytes_that_are_not_an_event_raise_undecodable_with_a_reason(data, reason):
    with pytest.raises(UndecodableEvent) as e:
        codec().decode(data, "trajectory")
    assert reason in e.value.reason


def test_truncated_body_is_undecodable():
    data = codec().encode("trajectory", samples.trajectory())
    with pytest.raises(UndecodableEvent, match="corrupt trajectory body"):
        codec().decode(data[:-20], "trajectory")


def test_trailing_bytes_are_undecodable():
    data = codec().encode("metric", samples.metric())
    with pytest.raises(UndecodableEvent, match="trailing bytes"):
        codec().decode(data + b"\x00\x01", "metric")


def test_event_of_another_type_is_refused_on_a_typed_decode():
    data = codec().encode("metric", samples.metric())
    with pytest.raises(UndecodableEvent, match="expected a trajectory event, got a metric event"):
        codec().decode(data, "trajectory")


def test_value_that_does_not_match_the_schema_is_refused_before_writing():
    bad = samples.metric()
    bad["value"] = "not a number"
    with pytest.raises(InvalidEvent, match="metric"):
        codec().encode("metric", bad)
    missing = samples.step()
    del missing["pool"]
    with pytest.raises(InvalidEvent):
        codec().encode("step", missing)


def test_every_schema_field_is_documented():
    def fields(node):
        if isinstance(node, dict):
            if node.get("type") == "record":
                yield from ((node["name"], f) for f in node["fields"])
            for v in node.values():
                yield from fields(v)
        elif isinstance(node, list):
            for v in node:
                yield from fields(v)

    for event_type in EVENT_TYPES:
        schema = codec().schema(event_type)
        assert schema.get("doc"), event_type
        undocumented = [f"{rec}.{f['name']}" for rec, f in fields(schema) if not f.get("doc")]
        assert not undocumented, undocumented


def test_topic_definitions_agree_with_the_topic_constants():
    spec = yaml.safe_load((REPO_ROOT / "infra" / "topics.yaml").read_text())
    assert set(spec["topics"]) == set(topics.ALL_TOPICS)
    for name, t in spec["topics"].items():
        assert t["event"] == topics.EVENT_OF_TOPIC[name]
    assert set(spec["buckets"]) == set(topics.ALL_BUCKETS)
    assert spec["topics"]["engines"]["config"]["cleanup.policy"] == "compact"


def test_fingerprint_is_the_little_endian_crc64_of_the_canonical_form():
    fp = codec().fingerprint("metric")
    assert len(fp) == 8
    assert struct.unpack("<Q", fp)[0] != 0
