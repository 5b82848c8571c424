"""The follower of a run: a thread that reads the run's topics into its live view (pipeline/run/live_view.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import KafkaError

from pipeline.run.live_view import RunView
from schemas import topics
from schemas.assigned_reader import AssignedReader
from schemas.codec import UndecodableEvent, codec
from schemas.settings import KafkaSettings

QUIET_CLIENT_LOG = logging.getLogger("rollstream.run-view.kafka")
QUIET_CLIENT_LOG.setLevel(logging.CRITICAL)

FOLLOWED = (topics.TASKS_REQUESTED, topics.TRAJECTORIES, topics.STEPS, topics.WEIGHTS, topics.METRICS, topics.ENGINES,
            topics.ALERTS)


class RunFollower(threading.Thread):
    """Reads the run's events from `since_ms` on, into a RunView (guarded by `lock`)."""

    def __init__(self, kafka: KafkaSettings, view: RunView, since_ms: int) -> None:
        super().__init__(name="run-follower", daemon=True)
        self.view, self.lock, self._halt = view, threading.Lock(), threading.Event()
        self.undecodable = 0
        # librdkafka logs every refused connect (about 20 a second) while the broker restarts; the view
        # rides through that without a word on the screen it shares. A partition with nothing newer than
        # since_ms is read from its end; a reader left reading nothing by a broker restart is renewed.
        self._reader = AssignedReader(kafka, FOLLOWED, f"the run view of {view.run}", since_ms=since_ms,
                                      config={"group.id": f"rollstream-up-view.{view.run}",
                                              "enable.auto.commit": False, "logger": QUIET_CLIENT_LOG})

    @property
    def renewals(self) -> int:
        return self._reader.renewals

    def renew_reader(self, why: str) -> None:
        """Its reader renewed by the follower's own thread, at its next read."""
        self._reader.ask_renewal(why)

    def run(self) -> None:
        while not self._halt.is_set():
            for msg in self._reader.consume(500, timeout=0.5):
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        self.undecodable += 1
                    continue
                try:
                    event = codec().decode(msg.value(), topics.EVENT_OF_TOPIC[msg.topic()])
                except UndecodableEvent:
                    self.undecodable += 1  # the consumers of the run send it to `dlq`; the view only counts it
                    continue
                with self.lock:
                    self.view.apply(msg.topic(), event, int(time.time() * 1000))
        self._reader.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def wait_for_run_end(kafka: KafkaSettings, run: str, max_steps: int, final_round: int | None, timeout_s: float,
                     say: Callable[[str], None], poll_s: float = 2.0) -> bool:
    """Follows the run from its topics' start until its learner has published version `max_steps` and the
    validation round it triggers (`final_round`, None: none) has all its trajectories, as `rollstream up`
    waits before its report; False when `timeout_s` passes first. For processes that end a run they did
    not start (docker-compose.yml's report job)."""
    view = RunView(run)
    follower = RunFollower(kafka, view, since_ms=0)
    follower.start()
    deadline, said = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline:
            with follower.lock:
                version = view.learner_version
                final_done = final_round is None or view.validation_complete(final_round)
            if version >= max_steps and final_done:
                return True
            progress = f"learner at version {version} of {max_steps}" + (
                "" if version < max_steps else f"; waiting for validation round {final_round}")
            if progress != said:
                say(f"run {run}: {progress}")
                said = progress
            time.sleep(poll_s)
        return False
    finally:
        follower.stop()
