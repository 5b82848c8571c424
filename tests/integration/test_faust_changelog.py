"""A Faust worker with a changelog-backed table recovers its state after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas.bus import topic_partitions

pytestmark = pytest.mark.integration

APP = Path(__file__).with_name("faust_counter_app.py")


def _start_worker(infra, app_id, source, sink, datadir, log):
    return subprocess.Popen(
        [sys.executable, str(APP), infra.kafka.faust_broker, app_id, source, sink, str(datadir)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read_counts(consumer: Consumer, want: int, timeout_s: float) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            # keys are raw UTF-8, values Faust's default JSON
            out.append((msg.key().decode(), int(json.loads(msg.value()))))
    return out


def test_table_state_is_recovered_from_its_changelog_after_the_worker_is_killed(infra, tmp_path):
    run = uuid.uuid4().hex[:8]
    app_id, source, sink = f"counter-{run}", f"test-counter-in-{run}", f"test-counter-out-{run}"
    admin = AdminClient(infra.kafka.as_confluent())
    for fut in admin.create_topics([NewTopic(source, 1, 1), NewTopic(sink, 1, 1)]).values():
        fut.result()
    assert all(topic_partitions(admin, [source, sink]).values())  # in the metadata the worker subscribes by
    producer = Producer(infra.kafka.as_confluent())
    consumer = Consumer(infra.kafka.as_confluent(**{"group.id": f"reader-{run}", "auto.offset.reset": "earliest"}))
    consumer.assign([TopicPartition(sink, 0, 0)])
    log = open(tmp_path / "worker.log", "ab")

    def send(keys):
        for k in keys:
            producer.produce(source, key=k.encode(), value=b'"x"')
        producer.flush(10)

    worker = _start_worker(infra, app_id, source, sink, tmp_path / "data-1", log)
    try:
        send(["a", "b", "a", "a", "b"])
        first = _read_counts(consumer, 5, timeout_s=90)
        assert first == [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2)], (tmp_path / "worker.log").read_text()[-3000:]
        # Let Faust commit the source offsets it has processed (commit_interval is 2.8 s).
        time.sleep(4)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()

    # A fresh data directory: the only way back to the counts is the changelog topic.
    worker = _start_worker(infra, app_id, source, sink, tmp_path / "data-2", log)
    try:
        send(["a", "b"])
        second = _read_counts(consumer, 2, timeout_s=90)
        assert second == [("a", 4), ("b", 3)], (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        consumer.close()
        log.close()
        for fut in admin.delete_topics([source, sink, f"{app_id}-counts-changelog"]).values():
            try:
                fut.result()
            except Exception:
                pass  # best effort: leftovers of a unique run id harm nothing
