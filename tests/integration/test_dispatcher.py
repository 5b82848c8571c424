"""The dispatcher against the real broker: restart without re-dispatch or skip, and the
in-flight bound released by trained batches and dropped groups."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from helpers.events import weights
from helpers.topics import TopicReader
from typer.testing import CliRunner

from pipeline.cli import dispatch as dispatch_cmd
from pipeline.dispatch import logic
from pipeline.dispatch.dispatcher import ProgressReader, run_dispatcher
from pipeline.dispatch.sources import parse_sources
from schemas import samples, topics
from schemas.bus import EventProducer, now_ms

pytestmark = pytest.mark.integration


def _groups(reader: TopicReader, validation: bool) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in reader.events[topics.TASKS_REQUESTED]:
        if r["validation"] == validation:
            out.setdefault(r["group_id"], []).append(r)
    return out


def test_restarted_dispatcher_neither_redispatches_nor_skips(infra):
    run = f"disp-{uuid.uuid4().hex[:8]}"
    reader = TopicReader(infra.kafka, [topics.TASKS_REQUESTED], run=run)
    args = ["--run", run, "--families", "calc,db:dev", "--val-families", "kg:dev", "--group-size", "2",
            "--max-in-flight", "20", "--poll-s", "0.2", "--json"]
    runner = CliRunner()
    first = runner.invoke(dispatch_cmd.app, [*args, "--max-groups", "3"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(dispatch_cmd.app, [*args, "--max-groups", "5"])
    assert second.exit_code == 0, second.output
    summaries = [json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second)]
    assert [(s["dispatched_groups"], s["total_groups"], s["validation_rounds"]) for s in summaries] == \
        [(3, 3, [0]), (2, 5, [])]
    assert summaries[1]["resumed_at_position"] == 3

    reader.wait_for(lambda: len(_groups(reader, False)) >= 5, 20, "5 training groups")
    reader.poll(1.0)
    reader.close()
    training = _groups(reader, False)
    sources = parse_sources("calc,db:dev", "train")
    want = [logic.slot_at(sources, k) for k in range(5)]
    assert sorted(training) == sorted(logic.group_id(run, s.task, s.split, s.sample_index, s.epoch) for s in want)
    assert all(sorted(r["member"] for r in rs) == [0, 1] for rs in training.values())  # each exactly once
    validation = _groups(reader, True)
    assert validation and all(len(rs) == 4 and rs[0]["task"] == "kg" and rs[0]["epoch"] == 0
                              for rs in validation.values())


def test_in_flight_bound_is_released_by_trained_batches_and_dropped_groups(infra):
    run = f"flight-{uuid.uuid4().hex[:8]}"
    reader = TopicReader(infra.kafka, [topics.TASKS_REQUESTED], run=run)
    settings = logic.DispatcherSettings(sources=(logic.TaskSource(task="calc", split="train", count=100),),
                                        group_size=2, max_in_flight_groups=2)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run_dispatcher(infra.kafka, run, settings, 4, poll_s=0.2)))
    thread.start()
    producer = EventProducer(infra.kafka, client_id=run)
    try:
        reader.wait_for(lambda: len(_groups(reader, False)) >= 2, 20, "the first two groups")
        time.sleep(1.5)
        reader.poll(0.5)
        assert len(_groups(reader, False)) == 2  # the bound holds
        g0, g1 = sorted(_groups(reader, False), key=lambda g: _groups(reader, False)[g][0]["sample_index"])
        # a batch holding g0 counts once the learner answered it with a newer version
        producer.send(topics.BATCHES, {**samples.batch(), "run": run, "batch_id": f"{run}-b0", "credit_version": 0,
                                       "group_ids": [g0]}, key=f"{run}-b0")
        producer.send(topics.WEIGHTS, weights(run, 1), key=run)
        producer.flush()
        reader.wait_for(lambda: len(_groups(reader, False)) >= 3, 20, "a third group after the batch")
        producer.send(topics.METRICS, {**samples.metric(), "run": run, "name": "streams/group_dropped",
                                       "labels": {"group_id": g1, "reason": "stale"}, "at_ms": now_ms()})
        producer.flush()
        reader.wait_for(lambda: len(_groups(reader, False)) >= 4, 20, "a fourth group after the drop")
    finally:
        thread.join(30)
        producer.flush()
        reader.close()
    assert result["total_groups"] == 4
    assert sorted(r["sample_index"] for rs in _groups(reader, False).values() for r in rs[:1]) == [0, 1, 2, 3]


def test_a_renewed_progress_reader_follows_on_from_where_the_old_one_stopped(infra):
    run = f"renew-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(infra.kafka, client_id=run)
    progress_reader = ProgressReader(infra.kafka, run, check_s=1.0)
    try:
        producer.send(topics.WEIGHTS, weights(run, 1), key=run)
        producer.flush()
        deadline = time.monotonic() + 20
        while progress_reader.poll(0.5).learner_version < 1:
            assert time.monotonic() < deadline, "version 1 not read"
        for _ in range(6):  # checks that find nothing stuck renew nothing
            progress_reader.poll(0.5)
        assert progress_reader.renewals == 0
        progress_reader.renew()
        assert progress_reader.renewals == 1
        producer.send(topics.BATCHES, {**samples.batch(), "run": run, "batch_id": f"{run}-b1", "credit_version": 1,
                                       "group_ids": ["g"]}, key=f"{run}-b1")
        producer.send(topics.WEIGHTS, weights(run, 2), key=run)
        producer.flush()
        deadline = time.monotonic() + 20
        while progress_reader.poll(0.5).learner_version < 2:
            assert time.monotonic() < deadline, "version 2 not read by the renewed reader"
        assert progress_reader.progress.batches == {f"{run}-b1": (1, ["g"])}
    finally:
        progress_reader.close()
        producer.flush()
