"""`rollstream bench bus`: what the event bus and the object store cost on this machine.

Each figure stands beside a baseline measured in the same run:
- Kafka produce->consume throughput of trajectory-sized events (8k tokens, ~70 kB), against a raw
  loopback TCP copy of the same bytes (the ceiling any broker on this machine could reach);
- Kafka end-to-end latency p50/p99 at a steady rate (the paper's 64-GPU rate is ~30 traj/s);
- object-store put/get of one large object, against writing/reading the same bytes to a local file.
The headline `ratio` is Kafka MB/s for 70 kB events / loopback-socket MB/s.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from pipeline.run.config import load_config
from schemas import arrays, objectstore, samples, topics
from schemas.bus import EventConsumer, EventProducer
from schemas.codec import codec

MB = 1024 * 1024


def trajectory_event(i: int, tokens: int, rng: np.random.Generator) -> bytes:
    """An encoded trajectory of `tokens` tokens (byte-level ids, like the default policy's)."""
    t = samples.trajectory(member=i % 8, num_tokens=tokens)
    t["input_ids"] = arrays.pack_ids(rng.integers(0, 264, tokens))
    t["rollout_logprobs"] = arrays.pack_logprobs(-rng.exponential(1.0, tokens))
    return codec().encode("trajectory", t)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def loopback_copy(total_bytes: int, chunk: int) -> float:
    """MB/s of copying `total_bytes` through a loopback TCP connection in `chunk`-sized sends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while (n := len(conn.recv(1 << 20))) > 0:
                received[0] += n

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = os.urandom(chunk)
    start = time.perf_counter()
    with socket.create_connection(server.getsockname()) as c:
        sent = 0
        while sent < total_bytes:
            c.sendall(payload)
            sent += chunk
    t.join()
    elapsed = time.perf_counter() - start
    server.close()
    return received[0] / MB / elapsed


def kafka_throughput(cfg, events: list[bytes], progress: Progress) -> dict:
    marker = f"bench-{uuid.uuid4().hex[:10]}"
    producer = EventProducer(cfg.kafka, client_id=marker, **{"linger.ms": 20, "batch.size": 4 * MB})
    consumer = EventConsumer(cfg.kafka, group_id=marker, topic_names=[], client_id=marker, dlq=producer)
    consumer.assign({topics.TRAJECTORIES: consumer.end_offsets(topics.TRAJECTORIES)})
    task = progress.add_task("kafka throughput", total=len(events))
    got = 0
    done = threading.Event()

    def consume() -> None:
        nonlocal got
        while got < len(events):
            e = consumer.poll(1.0)
            if e is not None and e.key == marker.encode():
                got += 1
                progress.update(task, completed=got)
        done.set()

    start = time.perf_counter()
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    for data in events:
        producer.send_raw(topics.TRAJECTORIES, data, key=marker)
    producer.flush()
    done.wait(120)
    elapsed = time.perf_counter() - start
    consumer.close()
    total = sum(len(e) for e in events)
    return {"events": got, "seconds": elapsed, "events_per_s": got / elapsed, "mb_per_s": total / MB / elapsed,
            "event_bytes": total // len(events)}


def kafka_latency(cfg, events: list[bytes], rate: float, progress: Progress) -> dict:
    marker = f"lat-{uuid.uuid4().hex[:10]}"
    producer = EventProducer(cfg.kafka, client_id=marker, **{"linger.ms": 0})
    consumer = EventConsumer(cfg.kafka, group_id=marker, topic_names=[], client_id=marker, dlq=producer,
                             **{"fetch.wait.max.ms": 5})
    consumer.assign({topics.TRAJECTORIES: consumer.end_offsets(topics.TRAJECTORIES)})
    sent_at: dict[bytes, float] = {}
    latencies: list[float] = []
    task = progress.add_task(f"kafka latency at {rate:g}/s", total=len(events))

    def consume() -> None:
        while len(latencies) < len(events):
            e = consumer.poll(1.0)
            if e is not None and e.key in sent_at:
                latencies.append((time.perf_counter() - sent_at[e.key]) * 1000)
                progress.update(task, completed=len(latencies))

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(0.5)  # let the consumer's first fetch start
    for i, data in enumerate(events):
        key = f"{marker}-{i}".encode()
        sent_at[key] = time.perf_counter()
        producer.send_raw(topics.TRAJECTORIES, data, key=key)
        producer.poll(0)
        time.sleep(1.0 / rate)
    producer.flush()
    reader.join(60)
    consumer.close()
    return {"events": len(latencies), "rate_per_s": rate, "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "max_ms": max(latencies) if latencies else float("nan")}


def object_store_io(cfg, size_mb: int, progress: Progress) -> dict:
    mc = objectstore.client(cfg.object_store)
    key = f"bench/{uuid.uuid4().hex}.bin"
    task = progress.add_task(f"object store {size_mb} MB put/get and file baseline", total=4)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src.bin"
        data = os.urandom(size_mb * MB)
        digest = hashlib.sha256(data).hexdigest()
        # baseline: a local file write (flushed to disk) and read of the same bytes
        t = time.perf_counter()
        with open(src, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        file_write = size_mb / (time.perf_counter() - t)
        progress.advance(task)
        t = time.perf_counter()
        read_back = src.read_bytes()
        file_read = size_mb / (time.perf_counter() - t)
        assert hashlib.sha256(read_back).hexdigest() == digest
        del read_back
        progress.advance(task)
        t = time.perf_counter()
        objectstore.put_file(mc, topics.PAYLOADS_BUCKET, key, src)  # multipart above PART_SIZE
        put = size_mb / (time.perf_counter() - t)
        progress.advance(task)
        dst = Path(tmp) / "dst.bin"
        t = time.perf_counter()
        objectstore.get_file(mc, topics.PAYLOADS_BUCKET, key, dst)
        get = size_mb / (time.perf_counter() - t)
        progress.advance(task)
        intact = hashlib.sha256(dst.read_bytes()).hexdigest() == digest
        mc.remove_object(topics.PAYLOADS_BUCKET, key)
    return {"size_mb": size_mb, "put_mb_per_s": put, "get_mb_per_s": get, "file_write_mb_per_s": file_write,
            "file_read_mb_per_s": file_read, "put_ratio": put / file_write, "get_ratio": get / file_read,
            "sha256_intact": intact}


def bench_bus(
    events: int = typer.Option(1000, help="Trajectory events for the throughput run."),
    tokens: int = typer.Option(8192, help="Tokens per trajectory (8192 tokens = ~70 kB)."),
    latency_events: int = typer.Option(300, help="Events for the latency run."),
    rate: float = typer.Option(30.0, help="Events per second in the latency run (the paper's 64-GPU rate is ~30)."),
    object_mb: int = typer.Option(256, help="Object size for the object-store run, MB."),
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Measures Kafka throughput and latency for trajectory-sized events and object-store MB/s,
    each beside a local baseline measured in the same run.

    Example: rollstream bench bus --events 2000 --json
    """
    cfg = load_config(config)
    rng = np.random.default_rng(0)
    payloads = [trajectory_event(i, tokens, rng) for i in range(min(events, 64))]
    stream = [payloads[i % len(payloads)] for i in range(events)]
    with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as progress:
        thr = kafka_throughput(cfg, stream, progress)
        loop = loopback_copy(sum(len(e) for e in stream), len(stream[0]))
        lat = kafka_latency(cfg, stream[:latency_events], rate, progress)
        obj = object_store_io(cfg, object_mb, progress)
    result = {
        "ratio": thr["mb_per_s"] / loop,
        "kafka": {**thr, "loopback_socket_mb_per_s": loop, "ratio_to_loopback": thr["mb_per_s"] / loop},
        "kafka_latency": lat,
        "object_store": obj,
        "machine": {"cpus": os.cpu_count()},
    }
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title="rollstream bench bus")
    for col in ("measure", "rollstream path", "baseline (same run)", "ratio"):
        table.add_column(col)
    k = result["kafka"]
    table.add_row(f"Kafka produce->consume, {k['event_bytes'] / 1024:.0f} kB events",
                  f"{k['mb_per_s']:.1f} MB/s ({k['events_per_s']:.0f} ev/s)", f"loopback socket {loop:.1f} MB/s",
                  f"{k['ratio_to_loopback']:.3f}")
    table.add_row(f"Kafka end-to-end latency at {lat['rate_per_s']:g} ev/s",
                  f"p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms", "", "")
    table.add_row(f"object store put, {obj['size_mb']} MB", f"{obj['put_mb_per_s']:.1f} MB/s",
                  f"file write {obj['file_write_mb_per_s']:.1f} MB/s", f"{obj['put_ratio']:.3f}")
    table.add_row(f"object store get, {obj['size_mb']} MB", f"{obj['get_mb_per_s']:.1f} MB/s",
                  f"file read {obj['file_read_mb_per_s']:.1f} MB/s", f"{obj['get_ratio']:.3f}")
    Console().print(table)
