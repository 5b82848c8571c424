"""The topics and buckets of infra/topics.yaml: creating what is missing, the payload bucket's
expiry, and their state; and waiting for Kafka and the object store to answer.

Used by `rollstream infra` (pipeline/cli/infra.py); the services' addresses come from the run
configuration (pipeline/run/config.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
import yaml
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from minio import Minio
from minio.commonconfig import ENABLED, Filter
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule

from pipeline.run.config import REPO_ROOT, RollstreamConfig
from schemas import objectstore, topics
from schemas.bus import create_missing_topics
from schemas.settings import KafkaSettings

TOPICS_FILE = REPO_ROOT / "infra" / "topics.yaml"


class Unreachable(RuntimeError):
    """Kafka or the object store did not answer in time: the configuration names a service that is not
    there (or not yet). Commands report it in one line (pipeline/cli/toolkit.py)."""


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


def wait_for_kafka(kafka: KafkaSettings, timeout_s: float = 60.0) -> None:
    """Returns once the broker answers a metadata request; raises Unreachable after `timeout_s`."""
    # librdkafka's own log (a line per refused connection, written past Python's stderr) is off for the
    # probe: what went wrong is the one line of Unreachable.
    refused: list[KafkaError] = []

    def on_error(error: KafkaError) -> None:
        if error.code() == KafkaError._AUTHENTICATION:
            refused.append(error)

    admin = AdminClient(kafka.as_confluent(log_level=0, error_cb=on_error))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            return
        except KafkaException as e:  # while the broker starts, or when it is not there
            # Wrong credentials will not come right by waiting, and "did not answer" would send the user
            # looking for a broker that is there. librdkafka hands errors to error_cb only when polled.
            admin.poll(0)
            if refused:
                raise Unreachable(f"Kafka at {kafka.bootstrap_servers} refused the credentials of "
                                  f"{kafka.sasl_username or 'this client'!r} ({refused[0].str()})") from None
            if time.monotonic() >= deadline:
                reason = e.args[0] if e.args else e
                reason = reason.str() if hasattr(reason, "str") else str(reason)
                raise Unreachable(f"Kafka at {kafka.bootstrap_servers} did not answer within {timeout_s:g} s ({reason})") from None
            time.sleep(0.5)


def wait_for_object_store(mc: Minio, endpoint: str, timeout_s: float = 60.0) -> None:
    """Returns once the object store answers a request; raises Unreachable after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            mc.bucket_exists(topics.WEIGHTS_BUCKET)
            return
        except (urllib3.exceptions.HTTPError, OSError) as e:  # refused, reset, or retries exhausted
            if time.monotonic() >= deadline:
                raise Unreachable(f"the object store at {endpoint} did not answer within {timeout_s:g} s "
                                  f"({type(e).__name__})") from None
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
    """Every declared topic (exists, partitions, settings) and bucket (exists), after waiting up to
    `connect_timeout_s` for each service to answer."""
    wait_for_kafka(cfg.kafka, cfg.connect_timeout_s)
    admin = AdminClient(cfg.kafka.as_confluent())
    meta = admin.list_topics(timeout=10)
    configs = {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t.name) for t in spec.topics if t.name in meta.topics]
    for res, fut in admin.describe_configs(resources).items() if resources else []:
        entries = fut.result()
        configs[res.name] = {k: entries[k].value for k in ("cleanup.policy", "compression.type", "max.message.bytes", "retention.ms")}
    mc = objectstore.client(cfg.object_store)
    wait_for_object_store(mc, cfg.object_store.endpoint, cfg.connect_timeout_s)
    return {
        "kafka": {"bootstrap_servers": cfg.kafka.bootstrap_servers, "brokers": len(meta.brokers),
                  "topics": {t.name: {"exists": t.name in meta.topics,
                                      "partitions": len(meta.topics[t.name].partitions) if t.name in meta.topics else 0,
                                      "config": configs.get(t.name, {})} for t in spec.topics}},
        "object_store": {"endpoint": cfg.object_store.endpoint,
                         "buckets": {b: mc.bucket_exists(b) for b in spec.buckets}},
    }


@dataclass(frozen=True)
class InitResult:
    """What `init` did: topics and buckets created, topics whose partition count differs from the
    definition (left as they are), and bucket expiry changes (bucket, days or None for never, topic)."""

    topics: int
    created_topics: list[str]
    mismatched: list[str]
    buckets: int
    created_buckets: list[str]
    expiry_changes: list[tuple[str, int | None, str]]


class SpecMismatch(ValueError):
    """infra/topics.yaml and schemas/topics.py do not declare the same topics."""


def init(cfg: RollstreamConfig, spec: InfraSpec, wait_s: float) -> InitResult:
    """Waits up to `wait_s` for Kafka and the object store, then creates every missing topic and bucket
    and sets the payload bucket's expiry from its topic's retention."""
    undeclared = set(topics.ALL_TOPICS) ^ {t.name for t in spec.topics}
    if undeclared:
        raise SpecMismatch(f"infra/topics.yaml and schemas/topics.py disagree on: {sorted(undeclared)}")
    wait_for_kafka(cfg.kafka, wait_s)
    admin = AdminClient(cfg.kafka.as_confluent())
    created, mismatched = create_topics(admin, spec)
    mc = objectstore.client(cfg.object_store)
    wait_for_object_store(mc, cfg.object_store.endpoint, wait_s)
    buckets = objectstore.ensure_buckets(mc, spec.buckets)
    changes = []
    for bucket, topic in EXPIRES_WITH.items():
        days = expiration_days(topic_retention_ms(admin, topic))
        if ensure_expiration(mc, bucket, days):
            changes.append((bucket, days, topic))
    return InitResult(len(spec.topics), created, mismatched, len(spec.buckets), buckets, changes)
