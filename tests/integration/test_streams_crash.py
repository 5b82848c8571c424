"""SIGKILL the streams worker mid-stream and restart it with an empty data directory: after
downstream de-duplication (by batch id, then group id) every complete group is trained exactly
once, none is lost, and the members buffered before the crash come back from the changelog."""

from __future__ import annotations

import time
import uuid

import pytest
from helpers.events import trajectory, weights
from helpers.topics import TopicReader
from helpers.workers import WorkerProcess

from schemas import topics
from schemas.bus import EventProducer
from schemas.codec import codec
from schemas.eventref import EventFetcher
from streams.aggregator_agent import without_arrays
from streams.worker import start_at_end

pytestmark = pytest.mark.integration

N = 4
GROUPS = 10
OPTIONS = ["--no-web", "--sweep-interval-s", "0.5", "--group-size", str(N),
           "--batch-size", "1", "--first-batch-factor", "1.0", "--group-timeout-s", "300"]


def test_killed_worker_restarts_from_changelog_and_trains_every_group_exactly_once(infra, tmp_path):
    app_id, run = f"streams-crash-{uuid.uuid4().hex[:8]}", f"crash-{uuid.uuid4().hex[:8]}"
    start_at_end(infra.kafka, app_id)
    reader = TopicReader(infra.kafka, [topics.GROUPS, topics.BATCHES], run=run)
    producer = EventProducer(infra.kafka, client_id=app_id)
    gids = [f"{run}-g{i}" for i in range(GROUPS)]
    produced = {(g, m): trajectory(run, g, m, N, float((i + m) % 3) / 2, sample_index=i, num_tokens=8 + m)
                for i, g in enumerate(gids) for m in range(N)}
    answered: list[str] = []

    def send(members: list[tuple[str, int]]) -> None:
        for key in members:
            producer.send(topics.TRAJECTORIES, produced[key], key=key[0])
        producer.flush()

    def learner() -> None:  # answers each distinct batch with the next weight version
        for b in reader.events[topics.BATCHES]:
            if b["batch_id"] not in answered:
                answered.append(b["batch_id"])
                producer.send(topics.WEIGHTS, weights(run, len(answered)), key=run)
                producer.flush()

    first = WorkerProcess(app_id, tmp_path / "data-1", tmp_path / "worker.log", OPTIONS).start()
    second = WorkerProcess(app_id, tmp_path / "data-2", tmp_path / "worker.log", OPTIONS)
    try:
        # groups 0-3 complete, groups 4-9 only half there when the worker dies
        send([(g, m) for g in gids[:4] for m in range(N)] + [(g, m) for g in gids[4:] for m in (0, 1)])
        trained = lambda: {g for b in reader.events[topics.BATCHES] for g in b["group_ids"]}  # noqa: E731
        reader.wait_for(lambda: trained() >= set(gids[:4]), 60, "groups 0-3 in batches", learner, first.log_tail)
        time.sleep(4)  # Faust commits source offsets every 2.8 s: the half groups now live only in tables
        send([(g, 2) for g in gids[4:]])  # in flight when the worker dies
        first.kill()

        second.start()
        send([(g, 3) for g in gids[4:]])
        reader.wait_for(lambda: trained() >= set(gids), 90, lambda: f"all groups, got {sorted(trained())}",
                        learner, second.log_tail)
        reader.poll(1.0)
    finally:
        first.kill()
        second.stop()
        reader.close()
        producer.flush()

    # downstream de-duplication, as the learner does it: skip a batch id seen before, then any
    # group already trained (a batch cut again after the crash may differ from the first one)
    seen_batches: set[str] = set()
    trained_groups: list[str] = []
    for b in reader.events[topics.BATCHES]:
        if b["batch_id"] not in seen_batches:
            seen_batches.add(b["batch_id"])
            trained_groups += [g for g in b["group_ids"] if g not in trained_groups]
    assert sorted(trained_groups) == sorted(gids)

    groups = {}
    for g in reader.events[topics.GROUPS]:
        groups.setdefault(g["group_id"], g)
    for gid in gids[4:]:
        # members 0 and 1 were committed before the kill and came back only from the changelog
        assert groups[gid]["completion"] == "complete"
        # ... with the references to the trajectories events that hold their arrays
        members = [m["trajectory"] for m in groups[gid]["members"]]
        assert members == [{**without_arrays(produced[(gid, m)]), "arrays_uri": t["arrays_uri"]}
                           for m, t in zip(range(N), members)]
        with EventFetcher(infra.kafka) as fetcher:
            referred = fetcher.fetch_many(t["arrays_uri"] for t in members)
        assert [codec().decode(referred[t["arrays_uri"]], "trajectory") for t in members] == \
            [produced[(gid, m)] for m in range(N)]
