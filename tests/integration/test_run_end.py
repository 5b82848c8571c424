"""A process that did not start the run (docker-compose.yml's report job) waits for its end as `up` does:
the learner at max_steps, then the final validation round complete (pipeline/run/follower.py)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from pipeline.run.follower import wait_for_run_end
from schemas import samples, topics
from schemas.bus import EventProducer
from tests.helpers.events import trajectory, weights

pytestmark = pytest.mark.integration


def test_a_run_that_never_ends_times_out(infra):
    lines: list[str] = []
    assert not wait_for_run_end(infra.kafka, f"never-{uuid.uuid4().hex}", 2, None, timeout_s=3, say=lines.append,
                                poll_s=0.5)
    assert lines[0].endswith("learner at version 0 of 2")


def test_the_run_ends_when_its_final_validation_round_is_back_after_the_last_version(infra):
    run = f"end-{uuid.uuid4().hex}"
    with EventProducer(infra.kafka) as producer:
        for version in (1, 2):
            producer.send(topics.WEIGHTS, weights(run, version), key=run)
        producer.flush()
    ended: list[bool] = []
    waiter = threading.Thread(target=lambda: ended.append(
        wait_for_run_end(infra.kafka, run, 2, 1, timeout_s=60, say=lambda line: None, poll_s=0.5)))
    waiter.start()
    waiter.join(timeout=6)
    assert waiter.is_alive(), "ended before its final validation round came back"
    requested = {**samples.task_requested(), "run": run, "epoch": 1, "validation": True, "group_size": 1}
    done = trajectory(run, requested["group_id"], 0, 1, 1.0, validation=True)
    with EventProducer(infra.kafka) as producer:
        producer.send(topics.TASKS_REQUESTED, requested, key=run)
        producer.flush()
        time.sleep(2)  # read before its trajectory, as in a run (the follower reads each topic at its own pace)
        producer.send(topics.TRAJECTORIES, done, key=run)
        producer.flush()
    waiter.join(timeout=60)
    assert ended == [True]
