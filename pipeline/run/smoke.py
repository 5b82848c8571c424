"""The platform check behind `rollstream smoke`: one example event of every type through its real
topic and back through the codec, and one object through the object store."""

from __future__ import annotations

import json
import time
import uuid

from pipeline.run.config import RollstreamConfig
from pipeline.run.infra import wait_for_kafka, wait_for_object_store
from schemas import objectstore, samples, topics
from schemas.bus import EventConsumer, EventProducer

NOT_BUILT = [
    ("load and fault benchmarks (async vs sync, scaling, crash tests)", 8),
]


def run_smoke(cfg: RollstreamConfig, timeout_s: float = 30.0) -> dict:
    """Round-trips one event of every type and one object; returns what it saw. Raises Unreachable
    when Kafka or the object store does not answer within `connect_timeout_s`."""
    wait_for_kafka(cfg.kafka, cfg.connect_timeout_s)
    mc = objectstore.client(cfg.object_store)
    wait_for_object_store(mc, cfg.object_store.endpoint, cfg.connect_timeout_s)
    marker = f"smoke-{uuid.uuid4().hex[:12]}"
    results: dict[str, dict] = {}
    with EventProducer(cfg.kafka, client_id=marker) as producer:
        consumer = EventConsumer(cfg.kafka, group_id=marker, topic_names=[], client_id=marker, dlq=producer)
        try:
            # Start exactly at the current end of each topic, so only this run's events are read.
            consumer.assign({t: consumer.end_offsets(t) for t in topics.ALL_TOPICS})
            sent_at = time.monotonic()
            for topic, event_type in topics.EVENT_OF_TOPIC.items():
                producer.send(topic, samples.example(event_type), key=marker)
            producer.flush()
            deadline = time.monotonic() + timeout_s
            while len(results) < len(topics.ALL_TOPICS) and time.monotonic() < deadline:
                event = consumer.poll(0.5)
                if event is None or event.key != marker.encode():
                    continue
                expected = samples.example(topics.EVENT_OF_TOPIC[event.topic])
                results[event.topic] = {"event": topics.EVENT_OF_TOPIC[event.topic], "equal": event.value == expected,
                                        "partition": event.partition, "offset": event.offset,
                                        "latency_ms": round((time.monotonic() - sent_at) * 1000, 1)}
        finally:
            consumer.close()
    payload = json.dumps({"smoke": marker}).encode()
    key = f"smoke/{marker}.json"
    objectstore.put_bytes(mc, topics.PAYLOADS_BUCKET, key, payload)
    object_ok = objectstore.get_bytes(mc, topics.PAYLOADS_BUCKET, key) == payload
    mc.remove_object(topics.PAYLOADS_BUCKET, key)
    missing = [t for t in topics.ALL_TOPICS if t not in results]
    return {"ok": not missing and all(r["equal"] for r in results.values()) and object_ok,
            "topics": results, "missing": missing, "object_store_round_trip": object_ok,
            "not_built": [{"part": p, "issue": i} for p, i in NOT_BUILT]}
