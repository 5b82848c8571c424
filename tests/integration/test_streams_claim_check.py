"""Batches above the message limit travel as claim checks: the batcher stores them whole in MinIO,
the learner and replay fetch and verify them. Real Kafka, MinIO and streams worker, with a limit
low enough that every batch of the test is claim-checked."""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka.admin import AdminClient
from helpers.workers import SyntheticRun, WorkerProcess, feed_windowed
from minio.commonconfig import ENABLED, Filter
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule
from test_learner_process import make_batch, make_loop, save_tiny_model, weight_events
from typer.testing import CliRunner

from pipeline.cli import replay as replay_cmd
from pipeline.run import infra as run_infra
from pipeline.analysis.replay import read_topic, store_fetch
from schemas import codec as codec_module
from schemas import objectstore, topics
from schemas.bus import EventProducer
from streams.batcher_state import payload_key
from streams.batching import build_batch
from streams.settings import StreamsSettings
from streams.worker import start_at_end

pytestmark = pytest.mark.integration

N = 2
LIMIT = 512  # a batch of one group of two trajectories (arrays left in `trajectories`) encodes to over 1 kB
SETTINGS = StreamsSettings(group_size=N, batch_size=1, first_batch_factor=1.0)


def test_batches_above_the_limit_are_stored_in_minio_and_replay_decodes_them(infra, tmp_path):
    app_id = f"streams-claim-{uuid.uuid4().hex[:8]}"
    start_at_end(infra.kafka, app_id)
    worker = WorkerProcess(app_id, tmp_path / "data", tmp_path / "worker.log", [
        "--no-web", "--group-size", str(N), "--batch-size", "1", "--first-batch-factor", "1.0",
        "--batch-offload-bytes", str(LIMIT)]).start()
    r = SyntheticRun(infra.kafka, f"claim-{uuid.uuid4().hex[:8]}", seed=5, group_size=N, tokens=512,
                     topic_names=[topics.GROUPS])
    try:
        feed_windowed(r, 3, window=1, timeout_s=120)
    except Exception as e:
        raise AssertionError(f"{e}\n{worker.log_tail()}") from e
    finally:
        r.close()
        worker.stop()

    mc = objectstore.client(infra.object_store)
    groups = {g["group_id"]: g for g in r.reader.events[topics.GROUPS]}
    pointers = r.reader.events[topics.BATCHES]
    assert len(pointers) == 3
    resolved = []
    for p in pointers:
        key = payload_key(r.run, p["batch_id"])
        assert (p["items"], p["payload_uri"]) == ([], objectstore.uri(topics.PAYLOADS_BUCKET, key))
        stored = objectstore.get_bytes(mc, topics.PAYLOADS_BUCKET, key)
        assert p["payload_bytes"] == len(stored) > LIMIT
        whole = objectstore.resolve_claim_check(p, "batch", lambda uri: stored)
        want = build_batch(r.run, p["index"], p["credit_version"], [groups[g] for g in p["group_ids"]], SETTINGS,
                           p["created_at_ms"])
        assert {**whole, **dict.fromkeys(objectstore.PAYLOAD_FIELDS)} == want
        assert len(whole["items"]) == N
        resolved.append(whole)

    replayed = [rec.value for rec in read_topic(infra.kafka, topics.BATCHES, run=r.run,
                                                fetch=store_fetch(infra.object_store))]
    assert sorted(replayed, key=lambda b: b["index"]) == sorted(resolved, key=lambda b: b["index"])
    out = tmp_path / "batches.jsonl"
    result = CliRunner().invoke(replay_cmd.app, ["batches", "--run", r.run, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == {str(out): 3}  # other tests' garbage on the topic may be undecodable
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(len(row["item_trajectory_ids"]) == N for row in rows)


def test_learner_trains_a_claim_checked_batch_and_refuses_a_tampered_one(infra, tmp_path):
    run = f"learner-claim-{uuid.uuid4().hex[:10]}"
    mc = objectstore.client(infra.object_store)
    batches = [make_batch(run, i) for i in range(2)]
    pointers = []
    for i, b in enumerate(batches):
        data = codec_module.codec().encode("batch", b)
        key = payload_key(run, b["batch_id"])
        objectstore.put_bytes(mc, topics.PAYLOADS_BUCKET, key, data if i == 0 else data[:-1] + bytes([data[-1] ^ 1]))
        pointers.append(objectstore.claim_check(b, objectstore.uri(topics.PAYLOADS_BUCKET, key), data, {"items": []}))
    with EventProducer(infra.kafka) as producer:
        for p in pointers:
            producer.send(topics.BATCHES, p, key=p["batch_id"])
    loop = make_loop(infra, run, save_tiny_model(tmp_path / "model"), max_steps=2, idle_exit_s=30)
    state = loop.start(resume=False)
    with pytest.raises(objectstore.PayloadMismatch, match="sha256"):
        loop.loop(state)
    assert [e["batch_id"] for e in weight_events(infra, run, 2)] == [None, batches[0]["batch_id"]]


def test_replay_reports_a_batch_whose_stored_payload_was_deleted_and_writes_it_without_items(infra, tmp_path):
    run = f"expired-claim-{uuid.uuid4().hex[:10]}"
    mc = objectstore.client(infra.object_store)
    pointers = []
    for b in (make_batch(run, 0), make_batch(run, 1)):
        data = codec_module.codec().encode("batch", b)
        key = payload_key(run, b["batch_id"])
        objectstore.put_bytes(mc, topics.PAYLOADS_BUCKET, key, data)
        pointers.append(objectstore.claim_check(b, objectstore.uri(topics.PAYLOADS_BUCKET, key), data, {"items": []}))
    mc.remove_object(topics.PAYLOADS_BUCKET, payload_key(run, pointers[0]["batch_id"]))  # as its expiry would
    with EventProducer(infra.kafka) as producer:
        for p in pointers:
            producer.send(topics.BATCHES, p, key=p["batch_id"])

    out = tmp_path / "batches.jsonl"
    result = CliRunner().invoke(replay_cmd.app, ["batches", "--run", run, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == {str(out): 2}
    assert [(m["batch_id"], m["uri"]) for m in summary["missing_payloads"]] == [
        (pointers[0]["batch_id"], pointers[0]["payload_uri"])]
    assert f"batch {pointers[0]['batch_id']}: {pointers[0]['payload_uri']} no longer exists" in result.stderr
    gone, kept = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert (gone["num_items"], gone["item_trajectory_ids"], gone["group_ids"]) == (0, [], pointers[0]["group_ids"])
    assert gone["payload_uri"] == pointers[0]["payload_uri"]
    assert kept["num_items"] == 4 and kept["payload_uri"] == pointers[1]["payload_uri"]


def test_infra_init_expires_payloads_with_the_batches_retention_idempotently(infra):
    mc = objectstore.client(infra.object_store)
    days = run_infra.expiration_days(run_infra.topic_retention_ms(
        AdminClient(infra.kafka.as_confluent()), topics.BATCHES))
    rules = mc.get_bucket_lifecycle(topics.PAYLOADS_BUCKET).rules
    assert [(r.rule_id, r.expiration.days) for r in rules] == [(run_infra.EXPIRY_RULE_ID, days)]
    assert run_infra.ensure_expiration(mc, topics.PAYLOADS_BUCKET, days) is False

    bucket = f"expiry-{uuid.uuid4().hex[:10]}"
    mc.make_bucket(bucket)
    try:
        other = Rule(ENABLED, rule_filter=Filter(prefix="tmp/"), rule_id="someone-else",
                     expiration=Expiration(days=1))
        mc.set_bucket_lifecycle(bucket, LifecycleConfig([other]))
        assert run_infra.ensure_expiration(mc, bucket, 3) is True
        assert run_infra.ensure_expiration(mc, bucket, 3) is False
        assert run_infra.ensure_expiration(mc, bucket, 8) is True
        assert sorted((r.rule_id, r.expiration.days) for r in mc.get_bucket_lifecycle(bucket).rules) == [
            (run_infra.EXPIRY_RULE_ID, 8), ("someone-else", 1)]
        assert run_infra.ensure_expiration(mc, bucket, None) is True
        assert [r.rule_id for r in mc.get_bucket_lifecycle(bucket).rules] == ["someone-else"]
    finally:
        mc.remove_bucket(bucket)
