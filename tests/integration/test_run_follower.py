"""`up`'s run view on the real broker: a follower whose reader is renewed (what a broker restart that left it
reading nothing brings about, schemas/assigned_reader.py) goes on from where it stopped, and reads every
partition that has nothing newer than its start from the end."""

from __future__ import annotations

import time
import uuid

import pytest
from helpers.events import weights

from pipeline.run.follower import RunFollower
from pipeline.run.live_view import RunView
from schemas import topics
from schemas.bus import EventProducer, now_ms

pytestmark = pytest.mark.integration


def _version(follower: RunFollower) -> int:
    with follower.lock:
        return follower.view.snapshot(now_ms())["learner_version"]


def _wait_for_version(follower: RunFollower, version: int, what: str) -> None:
    deadline = time.monotonic() + 20
    while _version(follower) < version:
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_renewed_run_view_follows_on_from_where_the_old_reader_stopped(infra):
    run = f"view-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(infra.kafka, client_id=run)
    follower = RunFollower(infra.kafka, RunView(run), since_ms=now_ms() - 5000)
    follower.start()
    try:
        producer.send(topics.WEIGHTS, weights(run, 1), key=run)
        producer.flush()
        _wait_for_version(follower, 1, "version 1 not read")
        follower.renew_reader("the test asks")
        deadline = time.monotonic() + 20
        while follower.renewals < 1:
            assert time.monotonic() < deadline, "the reader was not renewed"
            time.sleep(0.2)
        producer.send(topics.WEIGHTS, weights(run, 2), key=run)
        producer.flush()
        _wait_for_version(follower, 2, "version 2 not read by the renewed reader")
    finally:
        follower.stop()
        producer.flush()
