"""Engine heartbeats on `engines` (compacted, key engine_id): who the engine is, which version it
serves, how loaded it is, and whether it answers.

The heartbeat runs in the `rollstream engine` supervisor, outside the vLLM server, and probes it
over HTTP (`/health`, `/rollstream/state`, `/metrics`) with a short timeout. So an engine that
hangs or dies is still reported: the next heartbeat (every `interval_s`) says healthy=false with
the probe's error, which is how an engine that stops answering is marked unhealthy within
`interval_s + probe_timeout_s` seconds.

An engine can answer and still serve nothing: while an update drains, loads or receives, or its
worker joins a weight-sync group, requests wait. The heartbeat says so (`busy`, `busy_for_ms`), and
one busy for longer than `stall_after_s` (a collective whose peer is gone blocks until its timeout)
is reported unhealthy until the work ends, so routing stops sending it turns.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Gauge

from schemas import topics
from schemas.bus import EventProducer

# What the supervisor's Prometheus endpoint shows, from each heartbeat (schemas/prometheus.py); vLLM's own
# metrics stay on the engine's port, at /metrics.
SERVED_VERSION = Gauge("rollstream_engine_weight_version", "Weight version the engine serves.", registry=None)
REQUESTS_RUNNING = Gauge("rollstream_engine_requests_running", "Requests vLLM is running.", registry=None)
REQUESTS_WAITING = Gauge("rollstream_engine_requests_waiting", "Requests waiting: vLLM's queue and those held "
                         "at the gate of a weight update.", registry=None)
BUSY = Gauge("rollstream_engine_busy", "1 while the engine serves nothing: an update drains, loads or receives "
             "weights, or its worker joins a weight-sync group.", registry=None)
HEALTHY = Gauge("rollstream_engine_healthy", "1 when the engine answered its last probe and is not stalled.",
                registry=None)
PROMETHEUS = (SERVED_VERSION, REQUESTS_RUNNING, REQUESTS_WAITING, BUSY, HEALTHY)

_METRIC_LINE = re.compile(r"^(vllm:num_requests_(?:waiting|running))(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def parse_queue_metrics(text: str) -> tuple[int, int]:
    """(waiting, running) from vLLM's Prometheus /metrics text, summed over label sets."""
    totals = {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            totals[match.group(1)] += float(match.group(2))
    return int(totals["vllm:num_requests_waiting"]), int(totals["vllm:num_requests_running"])


@dataclass(frozen=True)
class Probe:
    """One look at the server."""

    healthy: bool
    version: int | None
    waiting: int
    running: int
    detail: str
    busy: str = ""
    busy_for_s: float = 0.0


def probe(client: httpx.Client, url: str, timeout_s: float) -> Probe:
    """Asks the server for its health, loaded version and queue; never raises."""
    try:
        health = client.get(f"{url}/health", timeout=timeout_s)
        if health.status_code != 200:
            return Probe(False, None, 0, 0, f"/health answered HTTP {health.status_code}")
        state = client.get(f"{url}/rollstream/state", timeout=timeout_s).json()
        waiting, running = parse_queue_metrics(client.get(f"{url}/metrics", timeout=timeout_s).text)
    except (httpx.HTTPError, ValueError) as error:
        return Probe(False, None, 0, 0, f"probe failed: {error!r}")
    detail = f"last update refused: {state['last_error']}" if state.get("last_error") else ""
    # Requests held at the update gate are not in vLLM's queue yet, but they are waiting.
    return Probe(True, int(state["version"]), waiting + (state["in_flight"] if state["updating"] else 0),
                 running, detail, busy=state.get("busy", ""), busy_for_s=float(state.get("busy_for_s", 0.0)))


def heartbeat_event(*, engine_id: str, pool: str, url: str, model: str, run: str, loaded_version: int,
                    probe: Probe, sent_at_ms: int, detail: str = "", stall_after_s: float = float("inf")) -> dict[str, Any]:
    """The engine_heartbeat event (schemas/avro/engine_heartbeat.avsc). An engine busy (see Probe.busy)
    for longer than `stall_after_s` is reported unhealthy: it answers, but serves nothing."""
    stalled = bool(probe.busy) and probe.busy_for_s > stall_after_s
    notes = [probe.detail, detail]
    if probe.busy:
        notes.append(f"{'stalled: ' if stalled else ''}busy ({probe.busy}) for {probe.busy_for_s:.0f} s")
    return {"engine_id": engine_id, "pool": pool, "url": url, "model": model, "loaded_version": loaded_version,
            "queue_depth": probe.waiting, "running": probe.running, "healthy": probe.healthy and not stalled,
            "detail": "; ".join(d for d in notes if d), "sent_at_ms": sent_at_ms, "run": run,
            "busy": probe.busy, "busy_for_ms": int(probe.busy_for_s * 1000)}


def export(event: dict[str, Any]) -> None:
    """Sets the Prometheus gauges to a heartbeat's figures."""
    SERVED_VERSION.set(event["loaded_version"])
    REQUESTS_RUNNING.set(event["running"])
    REQUESTS_WAITING.set(event["queue_depth"])
    BUSY.set(1 if event["busy"] else 0)
    HEALTHY.set(1 if event["healthy"] else 0)


class Heartbeat:
    """Publishes a heartbeat every `interval_s` from a daemon thread until `stop()`.

    `loaded_version` is the server's own answer when it answers, else the last one known.
    `extra_detail` lets the owner add its state (e.g. the last staged download that failed).
    `run` is the run whose weights the engine follows ("": none in particular, offered to every run).
    `stall_after_s`: how long the engine may be busy with one update or join before it is reported unhealthy.
    """

    def __init__(self, producer: EventProducer, *, engine_id: str, pool: str, url: str, model: str,
                 interval_s: float, probe_timeout_s: float, initial_version: int, run: str = "",
                 stall_after_s: float = float("inf"), extra_detail: Callable[[], str] = str,
                 clock: Callable[[], float] = time.time) -> None:
        self._producer = producer
        self._fields = {"engine_id": engine_id, "pool": pool, "url": url, "model": model, "run": run}
        self._interval_s = interval_s
        self._probe_timeout_s = probe_timeout_s
        self._stall_after_s = stall_after_s
        self._extra_detail = extra_detail
        self._clock = clock
        self.loaded_version = initial_version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        # One client for every probe: a client per request (httpx.get) loads the CA bundle each time, 17 ms of CPU
        # here, three times a beat.
        self._client = httpx.Client()

    def beat(self) -> dict[str, Any]:
        """Probes and publishes one heartbeat; returns the event."""
        seen = probe(self._client, self._fields["url"], self._probe_timeout_s)
        if seen.version is not None:
            self.loaded_version = seen.version
        event = heartbeat_event(**self._fields, loaded_version=self.loaded_version, probe=seen,
                                sent_at_ms=int(self._clock() * 1000), detail=self._extra_detail(),
                                stall_after_s=self._stall_after_s)
        self._producer.send(topics.ENGINES, event, key=self._fields["engine_id"])
        self._producer.poll(0)
        export(event)
        return event

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.beat()
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 3 * self._probe_timeout_s)
        if not self._thread.is_alive():  # else its probe still uses the client; the process's end closes it
            self._client.close()
