"""`rollstream infra`: create the topics and buckets of infra/topics.yaml, and report their state."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
import yaml
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from minio import Minio
from minio.commonconfig import ENABLED, Filter
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule

from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from schemas import objectstore, topics
from schemas.bus import create_missing_topics

TOPICS_FILE = REPO_ROOT / "infra" / "topics.yaml"

app = typer.Typer(help="Local infrastructure: topics and buckets.", no_args_is_help=True)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    event: str


@dataclass(frozen=True)
class InfraSpec:
    topics: list[TopicSpec]
    buckets: list[str] = field(default_factory=list)


def load_spec(path: Path = TOPICS_FILE) -> InfraSpec:
    """Reads the declarative topic and bucket definition."""
    raw = yaml.safe_load(path.read_text())
    defaults = raw.get("defaults", {})
    specs = []
    for name, t in raw["topics"].items():
        config = {**defaults.get("config", {}), **(t.get("config") or {})}
        specs.append(TopicSpec(
            name=name, partitions=int(t["partitions"]),
            replication_factor=int(t.get("replication_factor", defaults.get("replication_factor", 1))),
            config={k: str(v) for k, v in config.items()}, event=t["event"]))
    return InfraSpec(topics=specs, buckets=list(raw.get("buckets", [])))


def wait_for_kafka(admin: AdminClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=5)
            return
        except Exception as e:  # KafkaException while the broker starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kafka did not answer within {timeout_s:.0f} s: {e}") from e
            time.sleep(0.5)


def create_topics(admin: AdminClient, spec: InfraSpec) -> tuple[list[str], list[str]]:
    """Creates missing topics. Returns (created, mismatched): existing topics whose partition
    count differs are reported, never changed behind the operator's back."""
    existing = admin.list_topics(timeout=10).topics
    created = create_missing_topics(admin, [NewTopic(t.name, t.partitions, t.replication_factor, config=t.config)
                                            for t in spec.topics if t.name not in existing])
    mismatched = [f"{t.name}: {len(existing[t.name].partitions)} partitions, defined {t.partitions}"
                  for t in spec.topics if t.name in existing and len(existing[t.name].partitions) != t.partitions]
    return created, mismatched


# -- payload expiry ---------------------------------------------------------------------------

EXPIRES_WITH: dict[str, str] = {topics.PAYLOADS_BUCKET: topics.BATCHES}
"""Buckets whose objects live as long as the events of a topic that point at them (claim checks)."""
EXPIRY_RULE_ID = "rollstream-expire-with-topic"
MS_PER_DAY = 86_400_000


def expiration_days(retention_ms: int) -> int | None:
    """The lifecycle expiration, in whole days as S3 needs them (rounded up, at least 1), that keeps
    an object at least as long as a topic with this retention.ms keeps events; None for a topic
    that keeps them forever (retention.ms -1)."""
    if retention_ms < 0:
        return None
    return max(1, -(-retention_ms // MS_PER_DAY))


def topic_retention_ms(admin: AdminClient, topic: str) -> int:
    """The topic's retention.ms as the broker applies it (its own setting, else the broker default)."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return int(admin.describe_configs([resource])[resource].result()["retention.ms"].value)


def ensure_expiration(mc: Minio, bucket: str, days: int | None) -> bool:
    """Makes the bucket's lifecycle expire every object `days` after it was written (None: never),
    leaving any other rule of the bucket as it is. Idempotent; returns whether it changed anything."""
    current = mc.get_bucket_lifecycle(bucket)
    rules = current.rules if current is not None else []
    others = [r for r in rules if r.rule_id != EXPIRY_RULE_ID]
    ours = [r for r in rules if r.rule_id == EXPIRY_RULE_ID]
    if days is None:
        if not ours:
            return False
        if others:
            mc.set_bucket_lifecycle(bucket, LifecycleConfig(others))
        else:
            mc.delete_bucket_lifecycle(bucket)
        return True
    if [(r.status, r.expiration.days if r.expiration else None) for r in ours] == [(ENABLED, days)]:
        return False
    rule = Rule(ENABLED, rule_filter=Filter(prefix=""), rule_id=EXPIRY_RULE_ID, expiration=Expiration(days=days))
    mc.set_bucket_lifecycle(bucket, LifecycleConfig([*others, rule]))
    return True


def describe(cfg: RollstreamConfig, spec: InfraSpec) -> dict[str, Any]:
    admin = AdminClient(cfg.kafka.as_confluent())
    meta = admin.list_topics(timeout=10)
    configs = {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t.name) for t in spec.topics if t.name in meta.topics]
    for res, fut in admin.describe_configs(resources).items() if resources else []:
        entries = fut.result()
        configs[res.name] = {k: entries[k].value for k in ("cleanup.policy", "compression.type", "max.message.bytes", "retention.ms")}
    mc = objectstore.client(cfg.object_store)
    return {
        "kafka": {"bootstrap_servers": cfg.kafka.bootstrap_servers, "brokers": len(meta.brokers),
                  "topics": {t.name: {"exists": t.name in meta.topics,
                                      "partitions": len(meta.topics[t.name].partitions) if t.name in meta.topics else 0,
                                      "config": configs.get(t.name, {})} for t in spec.topics}},
        "object_store": {"endpoint": cfg.object_store.endpoint,
                         "buckets": {b: mc.bucket_exists(b) for b in spec.buckets}},
    }


@app.command("init")
def init(config: Path | None = typer.Option(None, "--config", help="YAML configuration file.")) -> None:
    """Waits for Kafka and the object store, then creates every missing topic and bucket.

    Example: rollstream infra init
    """
    cfg = load_config(config)
    spec = load_spec()
    undeclared = set(topics.ALL_TOPICS) ^ {t.name for t in spec.topics}
    if undeclared:
        raise typer.BadParameter(f"infra/topics.yaml and schemas/topics.py disagree on: {sorted(undeclared)}")
    admin = AdminClient(cfg.kafka.as_confluent())
    wait_for_kafka(admin)
    created, mismatched = create_topics(admin, spec)
    for m in mismatched:
        print(f"[rollstream] warning: topic {m}", file=sys.stderr)
    mc = objectstore.client(cfg.object_store)
    buckets = objectstore.ensure_buckets(mc, spec.buckets)
    print(f"[rollstream] topics: {len(spec.topics)} ({len(created)} created); "
          f"buckets: {len(spec.buckets)} ({len(buckets)} created)", file=sys.stderr)
    for bucket, topic in EXPIRES_WITH.items():
        days = expiration_days(topic_retention_ms(admin, topic))
        if ensure_expiration(mc, bucket, days):
            print(f"[rollstream] bucket {bucket}: objects now expire "
                  f"{'never' if days is None else f'after {days} days'} (topic {topic}'s retention)", file=sys.stderr)


@app.command("status")
def status(config: Path | None = typer.Option(None, "--config", help="YAML configuration file."),
           as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Shows every topic (partitions, settings) and bucket, and whether it exists.

    Example: rollstream infra status --json
    """
    info = describe(load_config(config), load_spec())
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Kafka {info['kafka']['bootstrap_servers']} ({info['kafka']['brokers']} broker)")
    for col in ("topic", "exists", "partitions", "cleanup", "compression", "max bytes", "retention ms"):
        table.add_column(col)
    for name, t in info["kafka"]["topics"].items():
        c = t["config"]
        table.add_row(name, str(t["exists"]), str(t["partitions"]), c.get("cleanup.policy", ""),
                      c.get("compression.type", ""), c.get("max.message.bytes", ""), c.get("retention.ms", ""))
    console = Console()
    console.print(table)
    for b, ok in info["object_store"]["buckets"].items():
        console.print(f"bucket {b}: {'exists' if ok else 'MISSING'}")
