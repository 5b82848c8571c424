"""The env worker (ARCHITECTURE.md "Processes"): a Kafka consumer in one consumer group on `tasks`
that runs up to `max_concurrency` agent loops at once (asyncio), each against its own environment
session, publishes every finished turn to `steps` and every trajectory to `trajectories` (key
group_id, deterministic trajectory id), and commits a task's offset only when that task and all
earlier ones in its partition have their trajectory acknowledged by the broker.

Delivery (at-least-once, ARCHITECTURE.md "Delivery guarantees"):
- `Watermarks` is the commit rule: per partition, the committed offset only moves past a
  contiguous run of acknowledged tasks, so a crash at any moment re-delivers exactly the tasks
  whose trajectories may not be durable.
- SIGKILL: nothing beyond the watermark was committed; another worker of the group rolls those
  tasks out again. The duplicates carry the same trajectory id; consumers keep the first by id.
  With seeded sampling (env_workers/engines.py; CUDA engines) they also carry the same tokens.
- Rebalance (cooperative-sticky): for the revoked partitions only, what is finished is flushed
  and committed inside the revoke callback; rollouts still running for them are cancelled (their
  session ended, no trajectory sent) because the new owner rolls them out from the committed
  offset anyway. Partitions lost without a clean revoke are dropped without committing.
- SIGTERM (`stop` set): stop taking tasks, let in-flight rollouts finish for up to
  `drain_timeout_s`, cancel what is left, flush, commit what is done, leave the group.
- A task that names no known family, split or sample goes to `dlq` with the reason, and counts as
  done once the dead letter is acknowledged: nothing is silently dropped.
The confluent-kafka consumer and producer are called from the event-loop thread only (polls with
timeout 0), so their callbacks never race the rollouts' bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition
from prometheus_client import Counter, Gauge

from env_workers.agent_loop import run_agent_loop
from env_workers.chat_template import ChatEncoder
from env_workers.engines import EnginePool, sampling_key
from env_workers.envs import registry
from env_workers.envs.base import Environment
from env_workers.worker_settings import EnvWorkerSettings
from schemas import topics
from schemas.bus import ConsumedEvent, EventConsumer, EventProducer, commit_retrying, dead_letter
from schemas.codec import codec
from schemas.settings import KafkaSettings

log = logging.getLogger(__name__)

Partition = tuple[str, int]

# Other runs' tasks passed over per loop turn: large enough that a history of tens of thousands of
# foreign tasks costs a second, small enough that the loop still serves rollouts and callbacks.
_PASS_OVER_BATCH = 500

# What the worker's Prometheus endpoint shows (schemas/prometheus.py), refreshed every EXPORT_INTERVAL_S.
TRAJECTORIES = Counter("rollstream_env_worker_trajectories", "Trajectories sent, by task and final status.",
                       ["task", "status"], registry=None)
TURNS = Counter("rollstream_env_worker_turns", "Turns (steps) sent, by task.", ["task"], registry=None)
IN_FLIGHT = Gauge("rollstream_env_worker_tasks_in_flight", "Rollouts running now.", registry=None)
CONSUMER_LAG = Gauge("rollstream_env_worker_consumer_lag", "Events of this worker's `tasks` partitions not yet "
                     "fetched (any run's): the end offsets the client last saw minus its positions.", registry=None)
PROMETHEUS = (TRAJECTORIES, TURNS, IN_FLIGHT, CONSUMER_LAG)
EXPORT_INTERVAL_S = 1.0


class Watermarks:
    """Per-partition contiguous commit watermark. Pure: offsets in, commit positions out.

    `track` each task as it is received, `done` when its trajectory is acknowledged;
    `committable` gives, per partition, the position (next offset) just past the longest run of
    done tasks from the start, and `committed` forgets that run. Gaps between tracked offsets
    (events that went to the dead-letter topic inside the consumer) do not hold the watermark.
    """

    def __init__(self) -> None:
        self._offsets: dict[Partition, dict[int, bool]] = {}

    def track(self, partition: Partition, offset: int) -> None:
        self._offsets.setdefault(partition, {})[offset] = False

    def done(self, partition: Partition, offset: int) -> None:
        """Marks a tracked task done; an offset no longer tracked (its partition was revoked) is ignored."""
        offsets = self._offsets.get(partition)
        if offsets is not None and offset in offsets:
            offsets[offset] = True

    def committable(self) -> dict[Partition, int]:
        """{partition: next offset to commit} for every partition whose watermark can move."""
        out: dict[Partition, int] = {}
        for partition, offsets in self._offsets.items():
            last = None
            for offset in sorted(offsets):
                if not offsets[offset]:
                    break
                last = offset
            if last is not None:
                out[partition] = last + 1
        return out

    def committed(self, partition: Partition, position: int) -> None:
        """Forgets the tasks below `position` (their offsets are committed)."""
        offsets = self._offsets.get(partition, {})
        for offset in [o for o in offsets if o < position]:
            del offsets[offset]

    def forget(self, partitions: Iterable[Partition]) -> None:
        for partition in partitions:
            self._offsets.pop(partition, None)

    def pending(self) -> int:
        """Tasks received and not yet committed."""
        return sum(len(offsets) for offsets in self._offsets.values())


class _TaskConsumer(EventConsumer):
    """EventConsumer with rebalance callbacks, pausing and commits by position."""

    def subscribe(self, names: list[str], on_assign: Callable[..., None], on_revoke: Callable[..., None],
                  on_lost: Callable[..., None]) -> None:
        self._consumer.subscribe(names, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)

    def set_paused(self, paused: bool, partitions: list[TopicPartition] | None = None) -> None:
        targets = partitions if partitions is not None else self._consumer.assignment()
        if targets:
            (self._consumer.pause if paused else self._consumer.resume)(targets)

    def commit_positions(self, positions: dict[Partition, int]) -> None:
        commit_retrying(self._consumer, [TopicPartition(t, p, o) for (t, p), o in positions.items()])

    def lag(self) -> int:
        """Events of the assigned partitions not fetched yet, from what the client knows (no broker round trip)."""
        total = 0
        for tp in self._consumer.position(self._consumer.assignment()):
            ends = self._consumer.get_watermark_offsets(tp, cached=True)
            if tp.offset >= 0 and ends is not None and ends[1] >= 0:
                total += max(0, ends[1] - tp.offset)
        return total


@dataclass
class WorkerStats:
    """Counts of what one worker did (its summary on exit)."""

    received: int = 0
    trajectories: int = 0
    steps: int = 0
    dead_lettered: int = 0
    cancelled: int = 0
    skipped: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


class WorkerFailed(RuntimeError):
    """The worker cannot go on (a broker refusal, a chat template the loop cannot use)."""


class EnvWorker:
    """One env-worker process's state; `run` is its life."""

    def __init__(self, settings: EnvWorkerSettings, kafka: KafkaSettings, encoder: ChatEncoder, engines: EnginePool,
                 *, run: str, worker_id: str, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.encoder, self.engines, self.run_id = settings, encoder, engines, run
        self.worker_id, self.clock = worker_id, clock
        self.producer = EventProducer(kafka, client_id=worker_id)
        # One consumer group per run: runs sharing the topic never take each other's tasks' offsets.
        self.consumer = _TaskConsumer(kafka, f"{settings.group_id}.{run}", [], client_id=worker_id, dlq=self.producer,
                                      **{"session.timeout.ms": int(settings.session_timeout_s * 1000),
                                         "heartbeat.interval.ms": int(settings.session_timeout_s * 1000 / 5)})
        self.heartbeats: EventConsumer | None = None
        if not settings.engine_urls:
            # Every worker reads the whole compacted `engines` topic, outside any group.
            self.heartbeats = EventConsumer(kafka, f"{worker_id}-engines", [], client_id=f"{worker_id}-engines",
                                            dlq=self.producer)
            partitions = self.heartbeats.end_offsets(topics.ENGINES)
            self.heartbeats.assign({topics.ENGINES: {p: OFFSET_BEGINNING for p in partitions}})
        self.watermarks = Watermarks()
        self.in_flight: dict[Partition, dict[int, asyncio.Task[None]]] = {}
        self.backlog: list[ConsumedEvent] = []
        self.paused = False
        self.failure: str | None = None
        self.stats = WorkerStats()
        self._envs: dict[str, Environment] = {}
        self._exported_at = float("-inf")

    # --- the life of the worker -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Consumes tasks until `stop` is set, then drains; raises WorkerFailed on a fatal error."""
        self.consumer.subscribe([topics.TASKS], self._on_assign, self._on_revoke, self._on_lost)
        try:
            while not stop.is_set() and self.failure is None:
                self._service()
                took = self._take_task()
                await asyncio.sleep(0 if took else self.settings.poll_interval_s)
            await self._drain()
        finally:
            left = self._cancel(list(self.in_flight))
            await asyncio.gather(*left, return_exceptions=True)  # lets each cancelled rollout end its session
            self._close()
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        return self.stats

    def _service(self) -> None:
        """Delivery reports, engine heartbeats and commits: cheap, non-blocking, every loop turn."""
        self.producer.poll(0)
        if self.heartbeats is not None:
            for _ in range(100):
                event = self.heartbeats.poll(0)
                if event is None:
                    break
                self.engines.update(event.value)
        self._commit_ready()
        if time.monotonic() - self._exported_at >= EXPORT_INTERVAL_S:
            self._exported_at = time.monotonic()
            IN_FLIGHT.set(self._running())
            CONSUMER_LAG.set(self.consumer.lag())

    def _take_task(self) -> bool:
        """Starts a task (from the backlog first, else the consumer); True when one started or was passed over.

        Other runs' tasks are passed over in one batch of up to `_PASS_OVER_BATCH` per loop turn, without
        a rollout: a new run's group reads the shared topic from its beginning, and one loop turn (one
        synchronous commit) per foreign task made a long history take minutes before the run's own tasks.
        """
        capacity = self._running() < self.settings.max_concurrency
        took = False
        if capacity and self.backlog:
            self._start(self.backlog.pop(0))
            took, capacity = True, self._running() < self.settings.max_concurrency
        # Polled even when full: it serves rebalance callbacks and keeps the member in the group.
        for _ in range(_PASS_OVER_BATCH):
            event = self.consumer.poll(0)
            if event is None:
                break
            took = True
            self.stats.received += 1
            partition = (event.topic, event.partition)
            self.watermarks.track(partition, event.offset)
            if event.value["request"]["run"] != self.run_id:  # not ours to roll out, nothing to wait for
                self.stats.skipped += 1
                self.watermarks.done(partition, event.offset)
                continue
            if capacity:
                self._start(event)
            else:  # fetched before the pause took effect
                self.backlog.append(event)
            break
        self._set_paused(self._running() + len(self.backlog) >= self.settings.max_concurrency)
        return took

    async def _drain(self) -> None:
        """SIGTERM: no new tasks; in-flight rollouts get `drain_timeout_s` to finish and be acknowledged."""
        self._set_paused(True)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        log.info("%s: draining %d rollouts", self.worker_id, self._running())
        while self._running() and time.monotonic() < deadline and self.failure is None:
            self._service()
            event = self.consumer.poll(0)
            if event is not None:  # not started: stays uncommitted, rolled out by another worker
                self.backlog.append(event)
            await asyncio.sleep(self.settings.poll_interval_s)

    def _close(self) -> None:
        try:
            self.producer.flush()
        except Exception as error:  # what was not acknowledged is not committed: it is rolled out again
            log.error("%s: flush on close failed: %s", self.worker_id, error)
        self.producer.poll(0)
        self._commit_ready()
        self.consumer.close()  # leaves the group: the revoke callback commits what is left
        if self.heartbeats is not None:
            self.heartbeats.close()

    # --- one task -------------------------------------------------------------------------------

    def _start(self, event: ConsumedEvent) -> None:
        partition = (event.topic, event.partition)
        task = asyncio.get_running_loop().create_task(self._rollout(event))
        self.in_flight.setdefault(partition, {})[event.offset] = task
        task.add_done_callback(partial(self._finished, event))

    async def _rollout(self, event: ConsumedEvent) -> None:
        task = event.value
        request = task["request"]
        try:
            sample = registry.sample(request["task"], request["split"], request["sample_index"], self.settings.env)
            env = self._env(request["task"])
        except (registry.UnknownFamily, IndexError) as error:
            log.error("%s: task at %s/%d/%d is unusable: %s", self.worker_id, event.topic, event.partition,
                      event.offset, error)
            self.stats.dead_lettered += 1
            self.producer.send(topics.DLQ, dead_letter(
                topic=event.topic, partition=event.partition, offset=event.offset, key=event.key,
                value=codec().encode(topics.EVENT_OF_TOPIC[topics.TASKS], task), error=error,
                consumer=self.consumer.group_id), key=event.key, on_delivery=partial(self._acked, event))
            return
        pick = self.engines.for_trajectory(sampling_key(self.settings.seed, request), self.settings.seeded_sampling)
        rollout = await run_agent_loop(task, sample, env, self.encoder, pick, self.settings.agent_loop,
                                       worker_id=self.worker_id, clock=self.clock, on_step=self._publish_step)
        trajectory = rollout.trajectory
        self.stats.statuses[trajectory["status"]] = self.stats.statuses.get(trajectory["status"], 0) + 1
        self.producer.send(topics.TRAJECTORIES, trajectory, key=request["group_id"],
                           on_delivery=partial(self._acked, event))
        self.stats.trajectories += 1
        TRAJECTORIES.labels(request["task"], trajectory["status"]).inc()

    def _env(self, family: str) -> Environment:
        # One instance per family serves every session: sessions carry all per-task state.
        if family not in self._envs:
            self._envs[family] = registry.environment(family, self.settings.env)
        return self._envs[family]

    def _publish_step(self, step: dict[str, Any]) -> None:
        self.producer.send(topics.STEPS, step, key=step["group_id"])
        self.stats.steps += 1
        TURNS.labels(step["task"]).inc()

    def _acked(self, event: ConsumedEvent, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            # The idempotent producer has exhausted its retries: stop, uncommitted tasks are re-rolled.
            self.failure = f"broker refused an event for task {event.partition}/{event.offset}: {error}"
            return
        self.watermarks.done((event.topic, event.partition), event.offset)

    def _finished(self, event: ConsumedEvent, task: asyncio.Task[None]) -> None:
        offsets = self.in_flight.get((event.topic, event.partition), {})
        if offsets.get(event.offset) is task:
            del offsets[event.offset]
        if task.cancelled():
            self.stats.cancelled += 1
            return
        error = task.exception()
        if error is not None:  # TemplatePrefixError or a bug: every further rollout would fail alike
            log.error("%s: rollout of task %d/%d failed", self.worker_id, event.partition, event.offset, exc_info=error)
            self.failure = f"rollout of task {event.partition}/{event.offset} raised {error!r}"

    # --- offsets and rebalances -----------------------------------------------------------------

    def _running(self) -> int:
        return sum(len(offsets) for offsets in self.in_flight.values())

    def _commit_ready(self) -> None:
        positions = self.watermarks.committable()
        if positions:
            try:
                self.consumer.commit_positions(positions)
            except KafkaException as error:
                # A rebalance in progress (or a coordinator move) refuses commits for a moment; the
                # watermark is kept and offered again next turn (or dropped with a revoked partition).
                log.warning("%s: commit deferred: %s", self.worker_id, error)
                return
            for partition, position in positions.items():
                self.watermarks.committed(partition, position)

    def _set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.consumer.set_paused(paused)
            self.paused = paused

    def _cancel(self, partitions: Iterable[Partition]) -> list[asyncio.Task[None]]:
        cancelled = []
        for partition in list(partitions):
            for task in self.in_flight.pop(partition, {}).values():
                task.cancel()
                cancelled.append(task)
        return cancelled

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        log.info("%s: assigned %s", self.worker_id, [p.partition for p in partitions])
        if partitions:
            # Assigned here (librdkafka would do it once this callback returns) to set the pause state
            # explicitly both ways: a partition paused while it was ours before keeps librdkafka's
            # pause flag through a revoke and a re-assignment, and `_set_paused` only resumes what is
            # assigned, so a partition that came back after a rebalance was never read again.
            consumer.incremental_assign(partitions)
            (consumer.pause if self.paused else consumer.resume)(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        revoked = {(p.topic, p.partition) for p in partitions}
        log.info("%s: revoked %s", self.worker_id, sorted(p for _, p in revoked))
        try:
            self.producer.flush()
            self.producer.poll(0)
            self._commit_ready()
        except Exception as error:  # not committed: the new owner rolls those tasks out again
            log.error("%s: commit on revoke failed: %s", self.worker_id, error)
        self._drop(revoked)

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        lost = {(p.topic, p.partition) for p in partitions}
        log.warning("%s: lost %s without a clean revoke", self.worker_id, sorted(p for _, p in lost))
        self._drop(lost)

    def _drop(self, partitions: set[Partition]) -> None:
        self._cancel(partitions)
        self.backlog = [e for e in self.backlog if (e.topic, e.partition) not in partitions]
        self.watermarks.forget(partitions)
