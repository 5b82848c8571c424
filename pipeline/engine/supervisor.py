"""One inference engine's supervisor, what `rollstream engine` runs: it starts vLLM's OpenAI server
with the rollstream pieces (pipeline/engine/server.py) as a child process, publishes heartbeats to
`engines` (pipeline/engine/heartbeat.py), and follows `weights` for its run: the current pool loads
every version, the stale pool every `stale_step`-th, from MinIO (pipeline/engine/updates.py) whenever
the engine does not already hold that version from the learner's broadcast. Events announced while
the engine was away are caught up by loading only the newest wanted one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import httpx
from minio import Minio
from minio.error import S3Error
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr

from env_workers.engine_client import auth_headers
from learner.manifest import ShardIntegrityError
from pipeline.engine.cpus import AUTO, valid_binding
from pipeline.engine.health import wait_until_serving
from pipeline.engine.heartbeat import PROMETHEUS, Heartbeat
from pipeline.engine.launch import popen_tied, set_session_niceness
from pipeline.engine.server import API_KEY_ENV, INITIAL_VERSION_ENV, vllm_command
from pipeline.engine.extension import HOLD_WEIGHTS_ENV
from pipeline.engine.poll import POLL_SLEEP_ENV
from pipeline.engine.updates import EngineControl, UpdateRefused, download_links, download_version, newest_to_load
from pipeline.run.config import RollstreamConfig
from schemas import objectstore, topics
from schemas.bus import ConsumedEvent, DeliveryError, EventConsumer, EventProducer
from schemas.precision import Precision, engine_dtype, host_cpu_flags
from schemas.prometheus import MetricsHost, MetricsPort, reachable_host, serve_metrics

# What refuses one version (the engine keeps serving the one it had), whichever path loads it.
REFUSALS = (ShardIntegrityError, UpdateRefused, S3Error, httpx.HTTPError, ValueError)

# How long a stopping engine waits for its last heartbeat to be acknowledged (the broker may be gone).
STOP_FLUSH_S = 10.0


KEEP_FREED_MEMORY = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
"""glibc malloc serves every block from its heap, in transparent huge pages, and never trims it. A weight update
allocates and frees the model's size in large tensors (the applied delta, vLLM's re-materialized layers and
their kernel-format copies); by default each is a fresh mmap whose 4 KiB pages the kernel zero-fills on first
touch, and each freed one goes back at once, so every update pays the page faults again. With this the next
update reuses the memory the last one freed (docs/BENCHMARKS.md, "bench weights": it halved vLLM's reload).
The cost: the process keeps its peak memory after an update instead of returning to its resting size."""


CPU_POLL_SLEEP_S = 0.0002
"""A CPU engine's sleep between polls (EngineSettings.poll_sleep_s): a step's result is seen at most 0.2 ms late,
beside steps of 10-30 ms, and a waiting process stops spinning (docs/BENCHMARKS.md, "vLLM's polling")."""


class EngineSettings(BaseModel):
    """One engine process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: Literal["current", "stale"] = "current"
    """Pool served: AgentRL's current engines (every version) or stale engines (25% of capacity)."""
    stale_step: int = 25
    """The stale pool loads every stale_step-th version: AgentRL stale_step 25."""
    max_model_len: int = 8192
    """Longest sequence served: the paper's max_total_len 8192."""
    dtype: Precision | None = None
    """vLLM's --dtype (not in the paper): None is float32 on a CPU and vLLM's own choice on a GPU; auto serves bfloat16
    on a CPU with AMX-BF16 or AVX512-BF16 (schemas/precision.py)."""
    heartbeat_interval_s: float = 2.0
    """Seconds between heartbeats (not in the paper): an unanswering engine is flagged within this plus the probe timeout."""
    probe_timeout_s: float = 2.0
    """HTTP timeout of each health probe (not in the paper)."""
    stall_after_s: float = Field(300.0, gt=0)
    """An engine busy with one weight update or group join longer than this is reported unhealthy until it
    ends (not in the paper): it answers probes but serves nothing, e.g. a broadcast whose learner is gone."""
    hold_weights: bool = True
    """The engine's worker keeps the verified tensors of the version it loaded from MinIO in host memory (one
    more copy of the weights per worker), so a delta version is applied there and loaded without being rebuilt
    on disk (not in the paper; pipeline/engine/updates.py). False rebuilds every delta version on disk."""
    kv_cache_space_gib: int = 1
    """vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE); vLLM's CPU default share of memory refuses to start on small hosts."""
    cpus: Annotated[str, AfterValidator(valid_binding)] = AUTO
    """Cores the vLLM worker's threads are bound to (VLLM_CPU_OMP_THREADS_BIND; CPU engines only): auto (vLLM's
    choice: every core but one, the same for every engine on the host), nobind, or a list such as 0-3,6
    (`rollstream up` gives each engine of a host its own: pipeline/engine/cpus.py)."""
    glibc_tunables: str = KEEP_FREED_MEMORY
    """GLIBC_TUNABLES of the vLLM server (not in the paper; empty: whatever the environment has). The default keeps
    the memory a weight update frees inside the process, for the next update to reuse, instead of giving every
    large block back to the kernel and faulting it in again page by page (see KEEP_FREED_MEMORY)."""
    poll_sleep_s: float | None = Field(None, ge=0, lt=1)
    """Seconds vLLM's engine core and its worker sleep between two polls of the shared-memory queues that join
    them (not in the paper; pipeline/engine/poll.py). vLLM's own loop yields the core and polls again at once for
    a second after each message, so each waiting process keeps a share of a core: on a CPU host, taken from the
    worker's threads, the learner and the other engines. 0 keeps vLLM's loop; None is CPU_POLL_SLEEP_S on a CPU
    engine and 0 on a GPU."""
    start_timeout_s: float = 600.0
    """How long the server may take to become healthy (about 40-55 s on 2 CPU cores)."""
    metrics_port: MetricsPort = None
    """Port of the supervisor's Prometheus /metrics (served version, requests, busy), None none, 0 any free port
    (schemas/prometheus.py; not in the paper). vLLM serves its own at /metrics on the engine's port."""
    metrics_host: MetricsHost = "127.0.0.1"
    """Address the supervisor's /metrics binds (not in the paper): 0.0.0.0 lets a scraper on another host (a
    Kubernetes pod's Prometheus) reach it; loopback by default so a process opens nothing it was not asked for."""


def _log(message: str) -> None:
    print(f"[engine] {message}", file=sys.stderr, flush=True)


class WeightFollower:
    """Follows `weights` for one run and loads, from MinIO, the versions this engine should serve."""

    def __init__(self, consumer: EventConsumer, mc: Minio, control: EngineControl, *, pool: str, run: str,
                 stale_step: int, download_root: Path, in_memory: bool = True) -> None:
        self._consumer, self._mc, self._control = consumer, mc, control
        self._pool, self._run, self._stale_step = pool, run, stale_step
        self._download_root = download_root
        self._in_memory = in_memory  # EngineSettings.hold_weights: the worker can apply deltas itself
        self.last_error = ""

    def poll_once(self, timeout_s: float) -> None:
        """Reads what is there (waiting up to `timeout_s` for the first event), loads the newest
        wanted version, then commits past everything read."""
        events: list[ConsumedEvent] = []
        event = self._consumer.poll(timeout_s)
        while event is not None:
            events.append(event)
            # What already arrived, without waiting: an update should not wait for events that may never come.
            event = self._consumer.poll(0.0)
        if not events:
            return
        announced = {e.value["version"]: e.value for e in events if e.value["run"] == self._run}
        served = self._control.state()["version"]
        target = newest_to_load(self._pool, list(announced), served, self._stale_step)
        if target is not None:
            self._load(announced[target], served)
        # Committed even after a refused version: the learner announces it only once, and the
        # next version supersedes it; the refusal stays visible in the heartbeats' detail.
        self._consumer.commit(events)

    def _load(self, event: dict, served: int) -> None:
        if self._in_memory and self._apply_deltas(event, served):
            return
        directory = self._download_root / f"v{event['version']:06d}"
        started = time.perf_counter()
        try:
            download_version(self._mc, event, directory)
            downloaded = time.perf_counter()
            result = self._control.load(event["version"], directory)
        except REFUSALS as error:
            self.last_error = f"version {event['version']} refused: {error}"
            _log(self.last_error)
            shutil.rmtree(directory, ignore_errors=True)
            return
        self.last_error = ""
        _log(f"loaded version {event['version']} from MinIO: download {downloaded - started:.2f} s, "
             f"drain {result['drain_s']:.2f} s, load {result['update_s'] - result['drain_s']:.2f} s")
        self._remove_downloads(keep=directory)

    def _apply_deltas(self, event: dict, served: int) -> bool:
        """The in-memory path (pipeline/engine/updates.py): True when the engine now serves the event's
        version; False when the full path must decide (not a delta on the served version, or refused)."""
        started = time.perf_counter()
        try:
            links = download_links(self._mc, event, served, self._download_root)
            if links is None:
                return False
            downloaded = time.perf_counter()
            result = self._control.apply_deltas(event["version"], links)
        except REFUSALS as error:
            # The full path fetches (and checks) everything again, so a corrupted delta is refused there too.
            _log(f"version {event['version']} not applied in memory ({error}); rebuilding it from the store")
            self._remove_downloads()
            return False
        self.last_error = ""
        _log(f"loaded version {event['version']} from MinIO in memory ({len(links)} delta(s) on version {served}): "
             f"download {downloaded - started:.2f} s, drain {result['drain_s']:.2f} s, apply {result['apply_s']:.2f} s, "
             f"load {result['load_s']:.2f} s")
        self._remove_downloads()
        return True

    def _remove_downloads(self, keep: Path | None = None) -> None:
        for old in self._download_root.glob("v*"):
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class EngineJob:
    """Where one engine serves what (the `rollstream engine` options)."""

    model: Path
    run: str
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 8000
    advertise_url: str = ""
    initial_version: int = 0
    work_dir: Path = Path(".run/engines")
    served_name: str = ""
    """The model id clients send; "" serves under `model`'s path (vLLM's default)."""

    @property
    def local_url(self) -> str:
        """Where the supervisor probes and updates its server; others are told the advertised address."""
        return f"http://{reachable_host(self.host)}:{self.port}"


class EngineFailed(RuntimeError):
    """The server did not come up, or exited on its own."""


def run_engine(cfg: RollstreamConfig, settings: EngineSettings, job: EngineJob) -> None:
    """Serves until SIGTERM/SIGINT; raises EngineFailed when the server does not come up or exits on
    its own (the server is stopped either way)."""
    serve_metrics(settings.metrics_port, f"engine {job.engine_id}", PROMETHEUS, host=settings.metrics_host)
    server = start_server(settings, job, cfg.agent_loop.engine_api_key)
    stopping = {"flag": False}

    def request_stop(signum: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    _supervise(cfg, settings, job, server, lambda: stopping["flag"])
    if not stopping["flag"]:
        raise EngineFailed(f"vLLM exited with code {server.returncode}")


def server_environment(inherited: Mapping[str, str], settings: EngineSettings, job: EngineJob,
                       api_key: SecretStr | None, *, on_gpu: bool = False) -> dict[str, str]:
    """The environment of the job's vLLM server: ours, with its initial version, CPU KV cache, polling and key."""
    env = {**inherited, INITIAL_VERSION_ENV: str(job.initial_version)}
    poll_sleep = settings.poll_sleep_s if settings.poll_sleep_s is not None else (0.0 if on_gpu else CPU_POLL_SLEEP_S)
    env[POLL_SLEEP_ENV] = repr(poll_sleep)
    # The key goes by environment, not --api-key: a command line is readable by every user of the host
    # (/proc/PID/cmdline). The setting alone decides: an inherited VLLM_API_KEY is not used.
    env.pop(API_KEY_ENV, None)
    if api_key is not None and api_key.get_secret_value():
        env[API_KEY_ENV] = api_key.get_secret_value()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_space_gib))
    if settings.cpus != AUTO:  # an explicit binding wins over an inherited one; auto leaves the environment's
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpus
    env[HOLD_WEIGHTS_ENV] = "1" if settings.hold_weights else "0"
    if settings.glibc_tunables:
        env["GLIBC_TUNABLES"] = settings.glibc_tunables
    return env


def start_server(settings: EngineSettings, job: EngineJob, api_key: SecretStr | None = None) -> subprocess.Popen:
    """vLLM's server for the job, in a session of its own, at this process's niceness; requiring `api_key`
    on its OpenAI routes when one is given."""
    on_gpu = _cuda_available()
    env = server_environment(os.environ, settings, job, api_key, on_gpu=on_gpu)
    command = vllm_command(str(job.model), host=job.host, port=job.port, max_model_len=settings.max_model_len,
                           dtype=engine_dtype(settings.dtype, on_gpu=on_gpu, flags=host_cpu_flags()),
                           enforce_eager=not on_gpu,
                           chunked_prefill=on_gpu, served_name=job.served_name)
    # vLLM's own log goes to our stderr; the server gets its own session so SIGTERM reaches its children,
    # and is tied to us: SIGTERM when we die without our cleanup (SIGKILL), instead of serving on as an orphan.
    server = popen_tied(command, stdout=sys.stderr, stderr=sys.stderr, env=env, start_new_session=True)
    # The server inherits this process's niceness (engines.nice) but leads a session of its own, where
    # the kernel schedules by session first: the session gets the same niceness, or the niceness counts for nothing.
    if niceness := os.getpriority(os.PRIO_PROCESS, 0):
        set_session_niceness(server.pid, niceness)
    return server


def _supervise(cfg: RollstreamConfig, settings: EngineSettings, job: EngineJob, server: subprocess.Popen,
               stopping: Callable[[], bool]) -> None:
    """Waits for the server, then heartbeats and follows `weights` until `stopping()` or the server exits."""
    producer: EventProducer | None = None
    consumer: EventConsumer | None = None
    heartbeat: Heartbeat | None = None
    url = job.local_url
    try:
        start_s = wait_until_serving(url, server, settings.start_timeout_s,
                                     headers=auth_headers(cfg.agent_loop.engine_api_key))
        _log(f"{job.engine_id} ({settings.pool}) serving {job.model} at {url}, healthy after {start_s:.1f} s; "
             f"vLLM's own metrics at {url}/metrics")
        mc = objectstore.client(cfg.object_store)
        producer = EventProducer(cfg.kafka, client_id=f"engine-{job.engine_id}")
        consumer = EventConsumer(cfg.kafka, f"rollstream-engine-{job.engine_id}", [topics.WEIGHTS],
                                 client_id=f"engine-{job.engine_id}", dlq=producer)
        follower = WeightFollower(consumer, mc, EngineControl(url, api_key=cfg.agent_loop.engine_api_key), pool=settings.pool, run=job.run,
                                  stale_step=settings.stale_step, download_root=job.work_dir / job.engine_id,
                                  in_memory=settings.hold_weights)
        heartbeat = Heartbeat(producer, engine_id=job.engine_id, run=job.run, pool=settings.pool,
                              url=job.advertise_url or url, model=job.served_name or str(job.model),
                              interval_s=settings.heartbeat_interval_s, probe_timeout_s=settings.probe_timeout_s,
                              initial_version=job.initial_version, stall_after_s=settings.stall_after_s,
                              extra_detail=lambda: follower.last_error)
        heartbeat.start()
        while not stopping() and server.poll() is None:
            follower.poll_once(1.0)
    except RuntimeError as error:  # the server did not come up (NotServing), or a client gave up
        raise EngineFailed(str(error)) from None
    finally:
        # The server first: it must not outlive us whatever the bus does (a flush to a broker that is
        # gone blocks for minutes and then raises; whoever stops us kills us before that, and vLLM,
        # in its own session, would be left serving).
        _stop_server(server)
        if heartbeat is not None:
            heartbeat.stop()
        try:
            if consumer is not None:
                consumer.close()
            if producer is not None:
                producer.flush(timeout=STOP_FLUSH_S)
        except DeliveryError as error:
            _log(f"{job.engine_id}: last events not delivered while stopping: {error}")


def _cuda_available() -> bool:
    import torch  # here: the supervisor itself never touches a device

    return torch.cuda.is_available()


def _stop_server(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
