"""The streams worker against the real broker: routing, groups, batches, dead letters.

One worker (a subprocess, as deployed) with its own app id serves the whole module; each test
uses its own run id and filters the shared DESIGN topics by it.
"""

from __future__ import annotations

import random
import socket
import time
import uuid

import httpx

import numpy as np
import pytest
from helpers.events import trajectory, weights
from helpers.topics import TopicReader
from helpers.workers import WorkerProcess

from schemas import samples, topics
from schemas.bus import EventProducer, now_ms
from schemas.codec import codec
from schemas.eventref import EventFetcher
from streams import routing
from streams.advantages import grpo_advantages
from streams.aggregator_agent import without_arrays
from streams.batching import build_batch
from streams.settings import StreamsSettings
from streams.worker import start_at_end

pytestmark = pytest.mark.integration

N = 4
SETTINGS = StreamsSettings(group_size=N, batch_size=1, first_batch_factor=1.0, min_members=2,
                           group_timeout_s=4.0)
WORKER_OPTIONS = ["--sweep-interval-s", "0.5", "--metrics-interval-s", "1",
                  "--group-size", str(N), "--batch-size", "1", "--first-batch-factor", "1.0",
                  "--min-members", "2", "--group-timeout-s", "4", "--loglevel", "WARNING"]


@pytest.fixture(scope="module")
def worker(infra, tmp_path_factory):
    app_id = f"streams-test-{uuid.uuid4().hex[:8]}"
    start_at_end(infra.kafka, app_id)
    tmp = tmp_path_factory.mktemp("streams")
    with socket.socket() as s:  # a free port for the worker's JSON view
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = WorkerProcess(app_id, tmp / "data", tmp / "worker.log", [*WORKER_OPTIONS, "--web-port", str(port)]).start()
    proc.web_port = port
    yield proc
    proc.stop()


@pytest.fixture
def producer(infra):
    with EventProducer(infra.kafka, client_id="streams-test") as p:
        yield p


def _learner(reader: TopicReader, producer: EventProducer, run: str, answered: set[str]):
    """Plays the learner: answers every new batch with the next weight version."""
    def answer() -> None:
        for batch in reader.events[topics.BATCHES]:
            if batch["batch_id"] not in answered:
                answered.add(batch["batch_id"])
                producer.send(topics.WEIGHTS, weights(run, len(answered)), key=run)
                producer.flush()
    return answer


def test_groups_and_batches_from_shuffled_duplicated_trajectories_with_a_lost_member(infra, worker, producer):
    run = f"pipe-{uuid.uuid4().hex[:8]}"
    reader = TopicReader(infra.kafka, [topics.GROUPS, topics.BATCHES, topics.METRICS], run=run)
    rewards = {f"{run}-g0": [1.0, 0.0, 0.5, 1.0], f"{run}-g1": [0.0, 0.0, 1.0, 0.25],
               f"{run}-g2": [1.0, 1.0, 0.0, 0.5], f"{run}-lost": [0.0, 1.0, 1.0, 0.0]}
    tasks = {f"{run}-g0": "db", f"{run}-g1": "db", f"{run}-g2": "calc", f"{run}-lost": "calc"}
    events = [trajectory(run, gid, m, N, r, task=tasks[gid], num_tokens=8 + 2 * m, sample_index=i)
              for i, (gid, rs) in enumerate(rewards.items()) for m, r in enumerate(rs)
              if (gid, m) != (f"{run}-lost", 3)]                       # member 3 never arrives
    events += [trajectory(run, f"{run}-dropped", 0, N, 1.0)]         # alone: too few members
    events += [trajectory(run, f"{run}-val", m, N, float(m % 2), validation=True) for m in range(N)]
    produced = {(t["group_id"], t["member"]): t for t in events}
    events += random.Random(7).sample(events, 5)                      # at-least-once duplicates
    random.Random(11).shuffle(events)
    for t in events:
        producer.send(topics.TRAJECTORIES, t, key=t["group_id"])
    producer.flush()

    answered: set[str] = set()
    learner = _learner(reader, producer, run, answered)
    emitted = lambda: {g["group_id"] for g in reader.events[topics.GROUPS]}  # noqa: E731
    trained = lambda: {g for b in reader.events[topics.BATCHES] for g in b["group_ids"]}  # noqa: E731
    dropped = lambda: [m for m in reader.events[topics.METRICS] if m["name"] == "streams/group_dropped"]  # noqa: E731
    try:
        # the lost-member group closes on its timeout with 3 trainable members, fewer than the
        # 4 a batch needs: one more group arriving after it lets the next cut take it
        reader.wait_for(lambda: f"{run}-lost" in emitted(), 30, "the timed-out group", learner, worker.log_tail)
        rewards[f"{run}-late"] = [0.0, 0.5, 0.5, 1.0]
        for m, r in enumerate(rewards[f"{run}-late"]):
            produced[(f"{run}-late", m)] = t = trajectory(run, f"{run}-late", m, N, r, num_tokens=12)
            producer.send(topics.TRAJECTORIES, t, key=t["group_id"])
        producer.flush()
        reader.wait_for(lambda: trained() >= set(rewards) and dropped(), 30,
                        lambda: f"batches of {sorted(rewards)}, got {sorted(trained())}", learner, worker.log_tail)
        reader.poll(1.0)
    finally:
        reader.close()
    expected_trained = set(rewards)

    groups = {g["group_id"]: g for g in reader.events[topics.GROUPS]}
    assert set(groups) == expected_trained | {f"{run}-val"}
    for gid, rs in rewards.items():
        g = groups[gid]
        kept = [m["trajectory"]["member"] for m in g["members"]]
        assert kept == ([0, 1, 2] if gid.endswith("lost") else [0, 1, 2, 3])
        want = grpo_advantages([rs[m] for m in kept], [gid] * len(kept))
        np.testing.assert_allclose([m["advantage"] for m in g["members"]], want, rtol=1e-12)
        assert g["completion"] == ("timeout" if gid.endswith("lost") else "complete")
        # members are the events as produced, their token arrays left in the trajectories event
        # each refers to, which holds them as produced
        members = [m["trajectory"] for m in g["members"]]
        assert members == [{**without_arrays(produced[(gid, m)]), "arrays_uri": t["arrays_uri"]}
                           for m, t in zip(kept, members)]
        with EventFetcher(infra.kafka) as fetcher:
            referred = fetcher.fetch_many(t["arrays_uri"] for t in members)
            assert fetcher._consumer.assignment() == []  # idle, it holds no partition, so it asks for nothing
        assert [codec().decode(referred[t["arrays_uri"]], "trajectory") for t in members] == \
            [produced[(gid, m)] for m in kept]

    batches = reader.events[topics.BATCHES]
    assert sorted(g for b in batches for g in b["group_ids"]) == sorted(expected_trained)  # each exactly once
    assert [b["index"] for b in batches] == list(range(len(batches)))
    assert [b["credit_version"] for b in batches] == list(range(len(batches)))
    for b in batches:
        want = build_batch(run, b["index"], b["credit_version"], [groups[g] for g in b["group_ids"]], SETTINGS,
                           b["created_at_ms"])
        assert b == want
    assert [(m["labels"]["group_id"], m["labels"]["reason"]) for m in dropped()] == [(f"{run}-dropped", "too_few_members")]


def test_router_attaches_the_pure_routing_plan(infra, worker, producer):
    run = f"route-{uuid.uuid4().hex[:8]}"
    reader = TopicReader(infra.kafka, [topics.TASKS], run=run)
    heartbeat = {**samples.engine_heartbeat(), "engine_id": f"{run}-stale", "pool": "stale",
                 "loaded_version": 0, "sent_at_ms": now_ms()}
    producer.send(topics.ENGINES, heartbeat, key=heartbeat["engine_id"])
    producer.flush()
    requests: list[dict] = []

    def route(group_id: str, validation: bool = False) -> set[str]:
        """Requests a group's tasks; returns their routing reasons."""
        group = [{**samples.task_requested(m), "run": run, "group_id": group_id, "group_size": N,
                  "validation": validation} for m in range(N)]
        for r in group:
            producer.send(topics.TASKS_REQUESTED, r, key=r["group_id"])
        producer.flush()
        requests.extend(group)
        mine = lambda: [t for t in reader.events[topics.TASKS] if t["request"]["group_id"] == group_id]  # noqa: E731
        reader.wait_for(lambda: len(mine()) >= N, 60, f"tasks of {group_id}", log=worker.log_tail)
        return {t["routing_reason"] for t in mine()}

    try:
        # the heartbeat reaches the router through its control topic, not in order with the
        # requests: groups are routed current-only until the router has it, then mixed
        deadline = time.monotonic() + 30
        k = 0
        while route(f"{run}-g{k}") != {"mixed"}:
            assert time.monotonic() < deadline, f"the router never planned with the stale engine\n{worker.log_tail()}"
            k += 1
        assert route(f"{run}-v", validation=True) == {"validation"}
    finally:
        reader.close()
    by_member = {(t["request"]["group_id"], t["request"]["member"]): t for t in reader.events[topics.TASKS]}
    assert len(by_member) == len(requests)
    for r in requests:
        task = by_member[(r["group_id"], r["member"])]
        assert task["request"] == r
        stale = routing.PoolState((heartbeat["engine_id"],), 0) if task["routing_reason"] == "mixed" else None
        plan = routing.plan_turn_pools(run, r["group_id"], r["member"], SETTINGS.max_turns, SETTINGS.stale_ratio,
                                       stale, r["validation"], SETTINGS.max_stale_lag, learner_version=0,
                                       stale_step=SETTINGS.stale_step)
        assert (task["turn_pools"], task["routing_seed"], task["routing_reason"]) == \
            (plan.turn_pools, plan.seed, plan.reason)


def test_undecodable_events_on_every_input_topic_land_in_dlq_with_a_reason(infra, worker, producer):
    marker = f"bad-{uuid.uuid4().hex[:8]}".encode()
    reader = TopicReader(infra.kafka, [topics.DLQ])
    inputs = [topics.TASKS_REQUESTED, topics.ENGINES, topics.WEIGHTS, topics.TRAJECTORIES, topics.GROUPS,
              topics.STEPS]
    for name in inputs:
        producer.send_raw(name, b"\x00not avro at all", key=marker)
    producer.flush()
    # other consumers of these topics (env workers, other deployments) dead-letter them too
    mine = lambda: [d for d, k in zip(reader.events[topics.DLQ], reader.keys[topics.DLQ])  # noqa: E731
                    if k == marker and d["consumer"].startswith(worker.app_id + "/")]
    try:
        # weights feed three jobs (router, aggregator, batcher) and trajectories two (aggregator, metrics)
        reader.wait_for(lambda: {d["source_topic"] for d in mine()} >= set(inputs), 60,
                        "dead letters", log=worker.log_tail)
    finally:
        reader.close()
    for d in mine():
        assert d["value"] == b"\x00not avro at all"
        assert "not an Avro single-object encoding" in d["reason"]


def test_metrics_view_serves_per_task_figures_as_json(infra, worker, producer):
    run = f"view-{uuid.uuid4().hex[:8]}"
    for m, status in enumerate(["completed", "task_error"]):
        t = trajectory(run, f"{run}-g", m, N, 1.0 - m, task="calc", status=status)
        producer.send(topics.TRAJECTORIES, t, key=t["group_id"])
    producer.flush()
    url = f"http://127.0.0.1:{worker.web_port}/rollstream/metrics/"
    deadline = time.monotonic() + 30
    while True:
        try:
            tasks = httpx.get(url, timeout=5).json().get(run, {}).get("tasks", {})
        except httpx.HTTPError:
            tasks = {}
        if tasks.get("calc", {}).get("trajectories") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert tasks["calc"]["status_shares"] == {"completed": 0.5, "task_error": 0.5}, worker.log_tail()
    assert tasks["calc"]["mean_reward"] == 0.5
