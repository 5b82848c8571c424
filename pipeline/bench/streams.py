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
one consumer group (how capacity grows with workers and partitions).

The helpers here (synthetic events, a worker subprocess, a topic reader) are what the streams
integration tests use too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import psutil
import typer
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.table import Table

from pipeline.run.config import REPO_ROOT, load_config
from schemas import arrays, samples, topics
from schemas.bus import EventProducer, now_ms
from schemas.codec import UndecodableEvent, codec
from schemas.settings import KafkaSettings
from streams.settings import StreamsSettings
from streams.worker import group_partitions, start_at_end

PAPER_RATE = 30.0  # trajectories/s of the paper's 64-GPU setup


# -- synthetic events ---------------------------------------------------------------------------

def trajectory(run: str, group_id: str, member: int, group_size: int, reward: float, *, task: str = "db",
               num_tokens: int = 16, status: str = "completed", version: int = 0, sample_index: int = 0,
               validation: bool = False, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """A valid trajectory event of one group member (schemas.samples.trajectory, re-addressed)."""
    # the example's arrays built with numpy: Python lists of 8k tokens took longer than the bench itself
    t = samples.trajectory(member=member, num_tokens=0, reward=reward)
    prompt = num_tokens // 2
    mask = np.repeat(np.array([0, 1], dtype=np.uint8), [prompt, num_tokens - prompt])
    ids = rng.integers(0, 264, num_tokens) if rng is not None else (np.arange(num_tokens) * 7 + member) % 256
    logprobs = (np.concatenate([np.zeros(prompt), -rng.exponential(1.0, num_tokens - prompt)]) if rng is not None
                else -0.25 * mask)
    t.update(input_ids=arrays.pack_ids(ids), loss_mask=arrays.pack_mask(mask),
             rollout_logprobs=arrays.pack_logprobs(logprobs), num_tokens=num_tokens, prompt_tokens=prompt)
    t["turns"] = [{**t["turns"][0], "start": prompt, "length": num_tokens - prompt}]
    t.update(trajectory_id=f"{group_id}-{member}", run=run, group_id=group_id, group_size=group_size, task=task,
             status=status, sample_index=sample_index, validation=validation, finished_at_ms=now_ms())
    t["turns"] = [{**turn, "weight_version": version} for turn in t["turns"]]
    return t


def weights(run: str, version: int) -> dict[str, Any]:
    """A weight_version event of the run (what the learner publishes after each step)."""
    return {**samples.weight_version(), "run": run, "version": version, "step": version,
            "published_at_ms": now_ms()}


# -- a worker subprocess ------------------------------------------------------------------------

@dataclass
class WorkerProcess:
    """`rollstream streams worker` as a subprocess (its own session, so SIGKILL takes it whole)."""

    app_id: str
    datadir: Path
    log_path: Path
    options: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    _log: IO[bytes] | None = None

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "pipeline.cli.streams", "worker", "--app-id", self.app_id,
               "--datadir", str(self.datadir), *self.options]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit (what a crash looks like)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


# -- reading outputs ----------------------------------------------------------------------------

class TopicReader:
    """Reads decoded events of some topics from their end at creation on, keeping a run's events."""

    def __init__(self, kafka: KafkaSettings, topic_names: Iterable[str], run: str | None = None) -> None:
        self.run = run
        self._consumer = Consumer(kafka.as_confluent(**{
            "group.id": f"reader-{uuid.uuid4().hex[:10]}", "enable.auto.commit": False,
            "fetch.message.max.bytes": kafka.message_max_bytes, "fetch.wait.max.ms": 5}))
        parts = []
        for name in topic_names:
            meta = self._consumer.list_topics(name, timeout=10).topics[name]
            for p in meta.partitions:
                end = self._consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1]
                parts.append(TopicPartition(name, p, end))
        self._consumer.assign(parts)
        self.events: dict[str, list[dict[str, Any]]] = {name: [] for name in topic_names}
        self.received_at: dict[str, list[float]] = {name: [] for name in topic_names}
        self.keys: dict[str, list[bytes | None]] = {name: [] for name in topic_names}

    def poll(self, timeout: float = 0.2) -> int:
        """Reads what has arrived (waiting up to `timeout`); returns how many events were kept."""
        kept = 0
        for msg in self._consumer.consume(500, timeout):
            if msg.error() is not None:
                continue
            name = msg.topic()
            try:
                value = codec().decode(msg.value(), topics.EVENT_OF_TOPIC[name])
            except UndecodableEvent:
                continue  # another producer's garbage; the streams app dead-letters it
            run = value.get("run", value.get("request", {}).get("run"))
            if self.run is not None and name != topics.DLQ and run != self.run:
                continue
            self.events[name].append(value)
            self.received_at[name].append(time.perf_counter())
            self.keys[name].append(msg.key())
            kept += 1
        return kept

    def wait_for(self, predicate, timeout_s: float, what: str = "", on_poll=None, log=None) -> None:  # type: ignore[no-untyped-def]
        """Polls until predicate() holds; AssertionError naming `what` (and log(), if given) on timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                detail = f"\n{log()}" if log is not None else ""
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what() if callable(what) else what}{detail}")
            self.poll()
            if on_poll is not None:
                on_poll()

    def close(self) -> None:
        self._consumer.close()


# -- the benchmark ------------------------------------------------------------------------------

GROUP_SIZE = 8
TOKENS = 8192
NEVER_STALE = 1_000_000
"""max_staleness of the bench's worker: its trajectories all carry version 0 (BenchRun, restamp=False)."""


class GroupsDropped(RuntimeError):
    """The aggregator dropped groups the benchmark waits for (the `streams/group_dropped` metric)."""


class BenchRun:
    """Feeds one run's groups to the worker and plays the learner (a weight version per batch).

    Trajectories carry the learner's latest version as their behaviour version when they are
    sent, as if generated by an up-to-date engine: stamped once up front (version 0), a run of
    more than max_staleness (40) batches had its later groups dropped as stale. With
    restamp=False they are encoded once up front (version 0) and sent as they are, which keeps the
    feeder's own CPU out of the measurement (it then took as much CPU as the worker); the worker
    must then be told a max_staleness above the run's number of batches."""

    def __init__(self, kafka: KafkaSettings, run: str, seed: int, *, group_size: int = GROUP_SIZE,
                 tokens: int = TOKENS, topic_names: Iterable[str] = (), restamp: bool = True) -> None:
        self.run = run
        self.restamp = restamp
        self.group_size = group_size
        self.tokens = tokens
        self.producer = EventProducer(kafka, client_id=f"bench-{run}", **{"linger.ms": 2})
        self.reader = TopicReader(kafka, {topics.BATCHES, topics.METRICS, *topic_names}, run=run)
        self.rng = np.random.default_rng(seed)
        self.answered: set[str] = set()
        self.batched_at: dict[str, float] = {}  # group_id -> when its batch was read
        self.dropped: dict[str, str] = {}  # group_id -> the aggregator's reason

    @property
    def version(self) -> int:
        """The learner's latest weight version (one per answered batch)."""
        return len(self.answered)

    def group_events(self, index: int) -> tuple[str, list[bytes], list[dict[str, Any] | bytes]]:
        """A group's n encoded task requests and n trajectories (arrays drawn up front; encoded
        too unless restamped when sent)."""
        gid = f"{self.run}-g{index}"
        requests = [codec().encode("task_requested", {**samples.task_requested(m), "run": self.run, "group_id": gid,
                                                      "group_size": self.group_size})
                    for m in range(self.group_size)]
        trajs: list[dict[str, Any] | bytes] = [
            trajectory(self.run, gid, m, self.group_size, float(self.rng.random() < 0.5), num_tokens=self.tokens,
                       sample_index=index, rng=self.rng) for m in range(self.group_size)]
        if not self.restamp:
            trajs = [codec().encode("trajectory", t) for t in trajs]
        return gid, requests, trajs

    def send(self, topic: str, gid: str, data: bytes) -> None:
        self.producer.send_raw(topic, data, key=gid)

    def send_trajectory(self, gid: str, t: dict[str, Any] | bytes) -> None:
        """Sends a trajectory generated on the learner's current version (or encoded up front)."""
        if isinstance(t, bytes):
            self.send(topics.TRAJECTORIES, gid, t)
            return
        turns = [{**turn, "weight_version": self.version} for turn in t["turns"]]
        self.send(topics.TRAJECTORIES, gid, codec().encode("trajectory", {**t, "turns": turns}))

    def send_group(self, group: tuple[str, list[bytes], list[dict[str, Any] | bytes]]) -> None:
        gid, requests, trajs = group
        for data in requests:
            self.send(topics.TASKS_REQUESTED, gid, data)
        for t in trajs:
            self.send_trajectory(gid, t)

    def pump(self, timeout: float) -> None:
        """Reads batches and answers each new one with the next weight version; notes dropped groups."""
        self.producer.poll(0)
        if not self.reader.poll(timeout):
            return
        now = time.perf_counter()
        for m in self.reader.events[topics.METRICS]:
            if m["name"] == topics.GROUP_DROPPED_METRIC:
                self.dropped.setdefault(m["labels"]["group_id"], m["labels"]["reason"])
        for batch in self.reader.events[topics.BATCHES]:
            if batch["batch_id"] in self.answered:
                continue
            self.answered.add(batch["batch_id"])
            for gid in batch["group_ids"]:
                self.batched_at.setdefault(gid, now)
            self.producer.send(topics.WEIGHTS, weights(self.run, self.version), key=self.run)
        # poll, not flush: a flush here waited for every trajectory in flight to be acknowledged
        # before the feeder could refill its window, and the feeder, not the worker, bounded the run
        self.producer.poll(0)

    def wait_batched(self, gids: Iterable[str], timeout_s: float) -> None:
        """Pumps until every group is in a batch; GroupsDropped as soon as one of them is dropped."""
        deadline = time.monotonic() + timeout_s
        want = set(gids)
        while not want <= set(self.batched_at):
            self.raise_if_dropped(want)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(want - set(self.batched_at))} groups not batched within {timeout_s:g} s")
            self.pump(0.05)

    def raise_if_dropped(self, gids: Iterable[str]) -> None:
        lost = {g: self.dropped[g] for g in gids if g in self.dropped}
        if lost:
            raise GroupsDropped(f"{len(lost)} groups dropped by the aggregator ({dict(Counter(lost.values()))}): "
                                f"{sorted(lost)[:5]}")

    def close(self) -> None:
        self.reader.close()
        self.producer.flush()


def feed_windowed(r: BenchRun, groups: int, window: int, timeout_s: float = 300, *, first: int = 0,
                  prepared: list[tuple[str, list[bytes], list[dict[str, Any] | bytes]]] | None = None) -> float:
    """Feeds groups first .. first+groups-1 (or the `prepared` ones), at most `window` of them not
    yet batched, until all are batched; returns the seconds it took."""
    if prepared is None:
        prepared = [r.group_events(i) for i in range(first, first + groups)]
    gids = [g[0] for g in prepared]
    start = time.perf_counter()
    sent = 0
    batched = 0
    while batched < groups:
        while sent < groups and sent - batched < window:
            r.send_group(prepared[sent])
            sent += 1
        r.pump(0.02)
        r.raise_if_dropped(gids)
        batched = sum(g in r.batched_at for g in gids)
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"only {batched} of {groups} groups batched in {timeout_s:g} s")
    return time.perf_counter() - start


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


def _cpu_seconds(processes: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of the processes themselves (0 for one that is gone): not of their
    children, since the feeder's children are the workers, counted apart."""
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def local_broker() -> psutil.Process | None:
    """The Kafka broker's process when it runs on this machine (infra/up.sh), else None."""
    for p in psutil.process_iter(["cmdline"]):
        if "kafka.Kafka" in (p.info["cmdline"] or []):
            return p
    return None


def measure_capacity(kafka: KafkaSettings, groups: int, window: int,
                     workers: Iterable[psutil.Process] = ()) -> dict[str, Any]:
    """Sustained trajectories/s with at most `window` groups fed and not yet batched, and the CPU
    seconds each party spent on it (the machine is shared: a worker's CPU per trajectory says
    what it would sustain with a core of its own)."""
    r = BenchRun(kafka, f"bench-cap-{uuid.uuid4().hex[:8]}", seed=1, restamp=False)
    parties = {"workers": list(workers), "feeder": [psutil.Process()]}
    broker = local_broker()
    if broker is not None:
        parties["broker"] = [broker]
    try:
        prepared = [r.group_events(i) for i in range(groups)]
        before = {name: _cpu_seconds(ps) for name, ps in parties.items()}
        elapsed = feed_windowed(r, groups, window, prepared=prepared)
        cpu = {name: _cpu_seconds(ps) - before[name] for name, ps in parties.items()}
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
    r = BenchRun(kafka, f"bench-lat-{uuid.uuid4().hex[:8]}", seed=2, restamp=False)
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


def bench_streams(
    groups: int = typer.Option(100, help="Groups of 8 x 8k-token trajectories for the capacity run."),
    window: int = typer.Option(64, help="Groups fed and not yet batched at most (the dispatcher's bound; "
                               "its default is 2 x batch_size, 512 groups at the paper's batch size)."),
    latency_seconds: float = typer.Option(10.0, help="Duration of the latency run at the paper's rate."),
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
    start_at_end(kafka, app_id)
    workdir = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    # the feeder sends trajectories encoded up front (version 0): no group may count as stale
    settings = workdir / "streams-settings.json"
    settings.write_text(StreamsSettings(group_size=GROUP_SIZE, batch_size=1, first_batch_factor=1.0,
                                        max_staleness=NEVER_STALE).model_dump_json())
    partitions = group_partitions(kafka)  # of trajectories and tasks.requested, which the jobs' tables mirror
    fleet = [WorkerProcess(app_id, workdir / f"data-{i}", workdir / f"worker-{i}.log", [
        "--no-web", "--settings", str(settings), "--sweep-interval-s", "1"]).start()
        for i in range(workers)]
    err = Console(stderr=True)
    try:
        err.print(f"warming up {workers} worker(s) ...")
        warm = BenchRun(kafka, f"bench-warm-{uuid.uuid4().hex[:8]}", seed=0, restamp=False)
        # one group per partition of the aggregator, so that every worker has handled events
        warmup = [warm.group_events(i) for i in range(partitions)]
        for group in warmup:
            warm.send_group(group)
        warm.wait_batched([g[0] for g in warmup], 180)
        warm.close()
        backlog = [topics.WEIGHTS, topics.ENGINES, f"{app_id}-router-in", f"{app_id}-aggregator-in"]
        err.print("waiting for the worker to catch up with earlier runs' weights and engines ...")
        wait_caught_up(kafka, app_id, backlog, 600)
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
        "scaling": "a worker is CPU-bound in its one Python thread: it sustains about "
                   "trajectories_per_worker_cpu_s per core it has to itself. The router, aggregator "
                   "and metrics jobs are partitioned like tasks.requested and trajectories (setup."
                   "partitions), and each partition is owned by one worker, so more workers on more "
                   "cores add capacity up to that partition count (more partitions: recreate those "
                   "topics with more); the batcher is one partition by design and handles one small "
                   "event per group (the arrays stay in `trajectories`), so it bounds one run far "
                   "above the rest. On a machine whose cores the broker and the feeder share with the "
                   "workers (2 cores here: they take about 0.6 of one), a second worker has no core of "
                   "its own, and with standby replicas (the default, 1) each worker also applies the "
                   "other's table changelogs, so there it adds no capacity",
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(title=f"rollstream bench streams (router + aggregator + batcher, {workers} worker(s))")
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


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(bench_streams)
