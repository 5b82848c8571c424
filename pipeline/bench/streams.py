"""`rollstream bench streams`: what the Faust stream processor sustains on this machine.

Runs a real streams worker (router + aggregator + batcher + metrics, as deployed) as a
subprocess against the real broker, and plays dispatcher, env workers and learner around it:
- capacity: groups of 8k-token trajectories are fed as fast as the pipeline takes them, with a
  bounded number in flight (the dispatcher's bound), and the learner answers each batch with a
  weight version at once; sustained trajectories/s = trajectories in batches / elapsed;
- latency at the paper's 64-GPU rate (~30 trajectories/s): the time from a group's last member
  being produced to the `batches` event that holds it, p50/p99.
The headline `ratio` is sustained trajectories/s / 30. The machine is shared by the workers,
the broker and the feeder, so the capacity run also reports each one's CPU seconds: a worker's
CPU per trajectory says what it sustains with a core of its own. `--workers N` runs N workers in
one consumer group (how capacity grows with workers and partitions). The synthetic load
(pipeline/run/synthetic_load.py) and the worker subprocess (pipeline/run/streams_worker.py) are
library code the streams integration tests drive too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import typer
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.table import Table

from pipeline.bench.cpu import cpu_seconds, local_broker
from pipeline.run.config import load_config
from pipeline.run.streams_worker import WorkerProcess
from pipeline.run.synthetic_load import (
    GROUP_SIZE,
    TOKENS,
    GroupsDropped,
    SyntheticRun,
    feed_windowed,
)
from schemas import topics
from schemas.settings import KafkaSettings
from streams.settings import StreamsSettings
from streams.worker import group_partitions, start_at_end

PAPER_RATE = 30.0  # trajectories/s of the paper's 64-GPU setup
NEVER_STALE = 1_000_000
"""max_staleness of the bench's worker: its trajectories all carry version 0 (SyntheticRun, restamp=False)."""


def wait_caught_up(kafka: KafkaSettings, app_id: str, topic_names: Iterable[str], timeout_s: float) -> None:
    """Waits until the app's consumer group has committed the end of each topic: the worker's
    control topics (seeded with the newest weight version per run and live heartbeats of earlier
    runs, streams/worker.py) and the warm-up's events are worked through before capacity is
    measured, so no backlog counts as capacity."""
    consumer = Consumer(kafka.as_confluent(**{"group.id": app_id, "enable.auto.commit": False}))
    try:
        parts = [TopicPartition(name, p) for name in topic_names
                 for p in consumer.list_topics(name, timeout=10).topics[name].partitions]
        deadline = time.monotonic() + timeout_s
        while True:
            ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
            behind = {(tp.topic, tp.partition): ends[(tp.topic, tp.partition)] - max(tp.offset, 0)
                      for tp in consumer.committed(parts, timeout=10)}
            if all(lag <= 0 for lag in behind.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not catch up with {sum(behind.values())} events of "
                                   f"{sorted({t for (t, _), lag in behind.items() if lag > 0})} in {timeout_s:g} s")
            time.sleep(0.5)
    finally:
        consumer.close()


def measure_capacity(kafka: KafkaSettings, groups: int, window: int,
                     workers: Iterable[psutil.Process] = ()) -> dict[str, Any]:
    """Sustained trajectories/s with at most `window` groups fed and not yet batched, and the CPU
    seconds each party spent on it (the machine is shared: a worker's CPU per trajectory says
    what it would sustain with a core of its own)."""
    r = SyntheticRun(kafka, f"bench-cap-{uuid.uuid4().hex[:8]}", seed=1, restamp=False)
    parties = {"workers": list(workers), "feeder": [psutil.Process()]}
    broker = local_broker()
    if broker is not None:
        parties["broker"] = [broker]
    try:
        prepared = [r.group_events(i) for i in range(groups)]
        before = {name: cpu_seconds(ps) for name, ps in parties.items()}
        elapsed = feed_windowed(r, groups, window, prepared=prepared)
        cpu = {name: cpu_seconds(ps) - before[name] for name, ps in parties.items()}
    finally:
        r.close()
    n = groups * GROUP_SIZE
    return {"groups": groups, "trajectories": n, "seconds": round(elapsed, 3),
            "trajectories_per_s": n / elapsed, "batches": len(r.answered), "window_groups": window,
            "cpu_seconds": {name: round(v, 2) for name, v in cpu.items()},
            "worker_cpu_ms_per_trajectory": 1000 * cpu["workers"] / n,
            "trajectories_per_worker_cpu_s": n / cpu["workers"] if cpu["workers"] > 0 else None}


def measure_latency(kafka: KafkaSettings, rate: float, seconds: float) -> dict[str, Any]:
    """Last member produced -> its batch read, at `rate` trajectories/s."""
    r = SyntheticRun(kafka, f"bench-lat-{uuid.uuid4().hex[:8]}", seed=2, restamp=False)
    groups = max(2, int(rate * seconds) // GROUP_SIZE)
    prepared = [r.group_events(i) for i in range(groups)]
    schedule = [(i * GROUP_SIZE + m) / rate for i in range(groups) for m in range(GROUP_SIZE)]
    last_sent: dict[str, float] = {}
    start = time.perf_counter()
    try:
        for k, due in enumerate(schedule):
            while time.perf_counter() - start < due:
                r.pump(min(0.005, max(0.0, due - (time.perf_counter() - start))))
            gid, requests, trajs = prepared[k // GROUP_SIZE]
            m = k % GROUP_SIZE
            r.send(topics.TASKS_REQUESTED, gid, requests[m])
            r.send_trajectory(gid, trajs[m])
            r.producer.poll(0)
            if m == GROUP_SIZE - 1:
                last_sent[gid] = time.perf_counter()
        r.wait_batched(last_sent, 120)
    finally:
        r.close()
    lat = [1000 * (r.batched_at[g] - last_sent[g]) for g in last_sent]
    return {"rate": rate, "groups": groups, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(max(lat))}


SCALING = (
    "a worker is CPU-bound in its one Python thread: it sustains about "
    "trajectories_per_worker_cpu_s per core it has to itself. The router, aggregator "
    "and metrics jobs are partitioned like tasks.requested and trajectories (setup."
    "partitions), and each partition is owned by one worker, so more workers on more "
    "cores add capacity up to that partition count (more partitions: recreate those "
    "topics with more); the batcher is one partition by design and handles one small "
    "event per group (the arrays stay in `trajectories`), so it bounds one run far "
    "above the rest. On a machine whose cores the broker and the feeder share with the "
    "workers (2 cores here: they take about 0.6 of one), a second worker has no core of "
    "its own, and with standby replicas (the default, 1) each worker also applies the "
    "other's table changelogs, so there it adds no capacity")


def start_fleet(kafka: KafkaSettings, app_id: str, workers: int, workdir: Path) -> list[WorkerProcess]:
    """`workers` streams workers of one consumer group that never count a group as stale (the
    feeder sends trajectories encoded up front, all on version 0)."""
    start_at_end(kafka, app_id)
    settings = workdir / "streams-settings.json"
    settings.write_text(StreamsSettings(group_size=GROUP_SIZE, batch_size=1, first_batch_factor=1.0,
                                        max_staleness=NEVER_STALE).model_dump_json())
    return [WorkerProcess(app_id, workdir / f"data-{i}", workdir / f"worker-{i}.log", [
        "--no-web", "--settings", str(settings), "--sweep-interval-s", "1"]).start()
        for i in range(workers)]


def warm_up(kafka: KafkaSettings, app_id: str, partitions: int, err: Console) -> None:
    """One group per partition of the aggregator, so that every worker has handled events; then
    waits until the workers have worked through every backlog, so that none counts as capacity."""
    warm = SyntheticRun(kafka, f"bench-warm-{uuid.uuid4().hex[:8]}", seed=0, restamp=False)
    try:
        warmup = [warm.group_events(i) for i in range(partitions)]
        for group in warmup:
            warm.send_group(group)
        warm.wait_batched([g[0] for g in warmup], 180)
    finally:
        warm.close()
    backlog = [topics.WEIGHTS, topics.ENGINES, f"{app_id}-router-in", f"{app_id}-aggregator-in"]
    err.print("waiting for the worker to catch up with earlier runs' weights and engines ...")
    wait_caught_up(kafka, app_id, backlog, 600)


def print_table(result: dict[str, Any]) -> None:
    capacity, latency = result["capacity"], result["latency"]
    table = Table(title=f"rollstream bench streams (router + aggregator + batcher, {result['setup']['workers']} worker(s))")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("sustained trajectories/s (8k tokens)", f"{capacity['trajectories_per_s']:.1f}")
    table.add_row(f"ratio to the paper's {PAPER_RATE:g}/s", f"{result['ratio']:.1f}x")
    table.add_row(f"latency p50 at {PAPER_RATE:g}/s (last member -> batch)", f"{latency['p50_ms']:.1f} ms")
    table.add_row(f"latency p99 at {PAPER_RATE:g}/s", f"{latency['p99_ms']:.1f} ms")
    table.add_row("worker CPU per trajectory", f"{capacity['worker_cpu_ms_per_trajectory']:.2f} ms")
    table.add_row("trajectories per worker CPU-second", f"{capacity['trajectories_per_worker_cpu_s']:.0f}")
    table.add_row("CPU seconds: workers / feeder / broker", " / ".join(
        f"{capacity['cpu_seconds'].get(k, float('nan')):.1f}" for k in ("workers", "feeder", "broker")))
    table.add_row("batches in the capacity run", str(capacity["batches"]))
    table.add_row("machine load average (1 min) at the end", f"{result['setup']['load_average_1m']:.1f}")
    Console().print(table)


def bench_streams(
    groups: int = typer.Option(100, min=1, help="Groups of 8 x 8k-token trajectories for the capacity run."),
    window: int = typer.Option(64, min=1, help="Groups fed and not yet batched at most (the dispatcher's bound; "
                               "its default is 2 x batch_size, 512 groups at the paper's batch size)."),
    latency_seconds: float = typer.Option(10.0, min=1.0, help="Duration of the latency run at the paper's rate."),
    workers: int = typer.Option(1, min=1, help="Streams workers sharing the work (one consumer group)."),
    config: Path | None = typer.Option(None, help="YAML run configuration (broker)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Measure the streams worker: sustained trajectories/s and last-member -> batch latency.

    Example:

        rollstream bench streams --json
    """
    kafka = load_config(config).kafka
    app_id = f"bench-streams-{uuid.uuid4().hex[:8]}"
    partitions = group_partitions(kafka)  # of trajectories and tasks.requested, which the jobs' tables mirror
    fleet = start_fleet(kafka, app_id, workers, Path(tempfile.mkdtemp(prefix="bench-streams-")))
    err = Console(stderr=True)
    try:
        err.print(f"warming up {workers} worker(s) ...")
        warm_up(kafka, app_id, partitions, err)
        err.print(f"capacity: {groups} groups of {GROUP_SIZE} x {TOKENS}-token trajectories ...")
        capacity = measure_capacity(kafka, groups, window, [psutil.Process(w.proc.pid) for w in fleet if w.proc])
        err.print(f"latency at {PAPER_RATE:g} trajectories/s for {latency_seconds:g} s ...")
        latency = measure_latency(kafka, PAPER_RATE, latency_seconds)
    except (TimeoutError, GroupsDropped) as e:
        typer.echo(f"rollstream bench streams: {e}\n{fleet[0].log_tail(2000)}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        for w in fleet:
            w.stop()
    result = {
        "ratio": capacity["trajectories_per_s"] / PAPER_RATE,
        "capacity": capacity,
        "latency": latency,
        # the machine is shared: the load average says how much of it the figures had
        "setup": {"workers": workers, "partitions": partitions, "tokens": TOKENS, "group_size": GROUP_SIZE,
                  "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "scaling": SCALING,
    }
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_table(result)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(bench_streams)
