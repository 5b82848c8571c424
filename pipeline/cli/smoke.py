"""`rollstream smoke`: the platform check.

Starts nothing itself (the infrastructure must be up: `make infra-up`); sends one example event of
every type through its real topic, reads each back through the codec, round-trips an object
through the object store, and says plainly which parts of rollstream are not built yet.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pipeline.run.config import load_config
from schemas import objectstore, samples, topics
from schemas.bus import EventConsumer, EventProducer

NOT_BUILT = [
    ("load and fault benchmarks (async vs sync, scaling, crash tests)", 8),
]


def run_smoke(config: Path | None = None, timeout_s: float = 30.0) -> dict:
    """Round-trips one event of every type and one object; returns what it saw."""
    cfg = load_config(config)
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
    mc = objectstore.client(cfg.object_store)
    payload = json.dumps({"smoke": marker}).encode()
    key = f"smoke/{marker}.json"
    objectstore.put_bytes(mc, topics.PAYLOADS_BUCKET, key, payload)
    object_ok = objectstore.get_bytes(mc, topics.PAYLOADS_BUCKET, key) == payload
    mc.remove_object(topics.PAYLOADS_BUCKET, key)
    missing = [t for t in topics.ALL_TOPICS if t not in results]
    return {"ok": not missing and all(r["equal"] for r in results.values()) and object_ok,
            "topics": results, "missing": missing, "object_store_round_trip": object_ok,
            "not_built": [{"part": p, "issue": i} for p, i in NOT_BUILT]}


def smoke(config: Path | None = typer.Option(None, "--config", help="YAML configuration file."),
          as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Sends one event of every type through the real broker and reads it back; checks the object store.

    Example: rollstream smoke --json
    """
    out = run_smoke(config)
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        console = Console()
        table = Table(title="One event of every type through Kafka")
        for col in ("topic", "event", "decoded equal", "partition", "offset", "latency ms"):
            table.add_column(col)
        for topic in topics.ALL_TOPICS:
            r = out["topics"].get(topic)
            table.add_row(topic, topics.EVENT_OF_TOPIC[topic], *(["MISSING", "", "", ""] if r is None else
                          [str(r["equal"]), str(r["partition"]), str(r["offset"]), str(r["latency_ms"])]))
        console.print(table)
        console.print(f"object store round trip: {'ok' if out['object_store_round_trip'] else 'FAILED'}")
        console.print("\n[bold]Not built yet[/bold]:")
        for item in out["not_built"]:
            console.print(f"  - {item['part']} (issue #{item['issue']})")
    if not out["ok"]:
        print("[rollstream] smoke run FAILED: see above", file=sys.stderr)
        raise typer.Exit(code=1)
