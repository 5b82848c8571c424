"""A sustained stream through a real streams worker: every group is emitted and trained exactly once.

The bench's learner answers each batch with a new weight version, so a long run drives the
learner far ahead of the run's first trajectories; the run must still lose nothing. One group
per batch first (more batches than max_staleness), then a burst fed all at once.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from helpers.workers import SyntheticRun, WorkerProcess, feed_windowed

from schemas import topics
from streams.settings import StreamsSettings
from streams.worker import start_at_end

pytestmark = pytest.mark.integration

N = 2
SEQUENTIAL = StreamsSettings().max_staleness + 10  # one batch each: the learner passes max_staleness
BURST = 30


def test_every_group_of_a_sustained_stream_is_emitted_and_batched_exactly_once(infra, tmp_path):
    app_id = f"streams-sustained-{uuid.uuid4().hex[:8]}"
    start_at_end(infra.kafka, app_id)
    worker = WorkerProcess(app_id, tmp_path / "data", tmp_path / "worker.log", [
        "--no-web", "--group-size", str(N), "--batch-size", "1",
        "--first-batch-factor", "1.0", "--sweep-interval-s", "0.5"]).start()
    r = SyntheticRun(infra.kafka, f"sustained-{uuid.uuid4().hex[:8]}", seed=3, group_size=N, tokens=64,
                     topic_names=[topics.GROUPS])
    try:
        feed_windowed(r, SEQUENTIAL, window=1, timeout_s=120)
        feed_windowed(r, BURST, window=BURST, timeout_s=60, first=SEQUENTIAL)
        r.reader.poll(1.0)  # a late duplicate would arrive now
    except Exception as e:
        raise AssertionError(f"{e}\n{worker.log_tail()}") from e
    finally:
        r.close()
        worker.stop()

    gids = [f"{r.run}-g{i}" for i in range(SEQUENTIAL + BURST)]
    assert r.dropped == {}
    assert Counter(g["group_id"] for g in r.reader.events[topics.GROUPS]) == Counter(gids)
    batches = r.reader.events[topics.BATCHES]
    assert Counter(g for b in batches for g in b["group_ids"]) == Counter(gids)
    assert [b["index"] for b in batches] == list(range(len(batches)))
    assert len(batches) > SEQUENTIAL
