"""`rollstream engine`: one inference engine of the current or the stale pool.

The command is a small supervisor: it starts vLLM's OpenAI server with the rollstream pieces
(pipeline/engine/server.py) as a child process, publishes heartbeats to `engines`
(pipeline/engine/heartbeat.py), and follows `weights` for its run: the current pool loads every
version, the stale pool every `stale_step`-th, from MinIO (pipeline/engine/updates.py) whenever
the engine does not already hold that version from the learner's broadcast. Events announced
while the engine was away are caught up by loading only the newest wanted one.

Register in pipeline/cli/__init__.py with `app.command("engine")(engine_cmd.engine)`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Literal

import httpx
import typer
from minio import Minio
from minio.error import S3Error
from pydantic import BaseModel, ConfigDict, Field

from learner.manifest import ShardIntegrityError
from pipeline.engine.heartbeat import Heartbeat
from pipeline.engine.launch import set_session_niceness
from pipeline.engine.server import INITIAL_VERSION_ENV, vllm_command
from pipeline.engine.updates import EngineControl, UpdateRefused, download_version, newest_to_load
from pipeline.run.config import load_config
from schemas import objectstore, topics
from schemas.bus import ConsumedEvent, DeliveryError, EventConsumer, EventProducer

app = typer.Typer(help="Serve a policy with vLLM, with live weight updates and heartbeats.")
# How long a stopping engine waits for its last heartbeat to be acknowledged (the broker may be gone).
STOP_FLUSH_S = 10.0


class EngineSettings(BaseModel):
    """One engine process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: Literal["current", "stale"] = "current"
    """Pool served: AgentRL's current engines (every version) or stale engines (25% of capacity)."""
    stale_step: int = 25
    """The stale pool loads every stale_step-th version: AgentRL stale_step 25."""
    max_model_len: int = 8192
    """Longest sequence served: the paper's max_total_len 8192."""
    heartbeat_interval_s: float = 2.0
    """Seconds between heartbeats (not in the paper): an unanswering engine is flagged within this plus the probe timeout."""
    probe_timeout_s: float = 2.0
    """HTTP timeout of each health probe (not in the paper)."""
    stall_after_s: float = Field(300.0, gt=0)
    """An engine busy with one weight update or group join longer than this is reported unhealthy until it
    ends (not in the paper): it answers probes but serves nothing, e.g. a broadcast whose learner is gone."""
    kv_cache_space_gib: int = 1
    """vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE); vLLM's CPU default share of memory refuses to start on small hosts."""
    start_timeout_s: float = 600.0
    """How long the server may take to become healthy (about 40-55 s on 2 CPU cores)."""


class Pool(str, Enum):
    current = "current"
    stale = "stale"


def _log(message: str) -> None:
    typer.echo(f"[engine] {message}", err=True)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until the server answered /health; raises RuntimeError if it exits or times out."""
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {process.returncode} before becoming healthy")
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


class WeightFollower:
    """Follows `weights` for one run and loads, from MinIO, the versions this engine should serve."""

    def __init__(self, consumer: EventConsumer, mc: Minio, control: EngineControl, *, pool: str, run: str,
                 stale_step: int, download_root: Path) -> None:
        self._consumer, self._mc, self._control = consumer, mc, control
        self._pool, self._run, self._stale_step = pool, run, stale_step
        self._download_root = download_root
        self.last_error = ""

    def poll_once(self, timeout_s: float) -> None:
        """Reads what is there (waiting up to `timeout_s` for the first event), loads the newest
        wanted version, then commits past everything read."""
        events: list[ConsumedEvent] = []
        event = self._consumer.poll(timeout_s)
        while event is not None:
            events.append(event)
            event = self._consumer.poll(0.2)
        if not events:
            return
        announced = {e.value["version"]: e.value for e in events if e.value["run"] == self._run}
        target = newest_to_load(self._pool, list(announced), self._control.state()["version"], self._stale_step)
        if target is not None:
            self._load(announced[target])
        # Committed even after a refused version: the learner announces it only once, and the
        # next version supersedes it; the refusal stays visible in the heartbeats' detail.
        self._consumer.commit(events)

    def _load(self, event: dict) -> None:
        directory = self._download_root / f"v{event['version']:06d}"
        started = time.perf_counter()
        try:
            download_version(self._mc, event, directory)
            downloaded = time.perf_counter()
            result = self._control.load(event["version"], directory)
        except (ShardIntegrityError, UpdateRefused, S3Error, httpx.HTTPError, ValueError) as error:
            self.last_error = f"version {event['version']} refused: {error}"
            _log(self.last_error)
            shutil.rmtree(directory, ignore_errors=True)
            return
        self.last_error = ""
        _log(f"loaded version {event['version']} from MinIO: download {downloaded - started:.2f} s, "
             f"drain {result['drain_s']:.2f} s, load {result['update_s'] - result['drain_s']:.2f} s")
        for old in self._download_root.glob("v*"):
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)


@app.command()
def engine(
    pool: Pool = typer.Option(..., "--pool", help="Engine pool: current (every version) or stale."),
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory to serve."),
    port: int = typer.Option(8000, "--port", help="Port of the OpenAI-compatible server."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on."),
    advertise_url: str = typer.Option("", "--advertise-url", help="URL other hosts reach this engine at, sent in "
                                      "heartbeats (default http://HOST:PORT; set it when HOST is 0.0.0.0)."),
    engine_id: str = typer.Option("", "--engine-id", help="Stable engine id (default: <pool>-<port>)."),
    run: str = typer.Option("", "--run", help="Run whose `weights` to follow (default: the configured run)."),
    initial_version: int = typer.Option(0, "--initial-version", help="Weight version of --model."),
    stale_step: int = typer.Option(EngineSettings().stale_step, "--stale-step", help="Stale pool refresh period."),
    max_model_len: int = typer.Option(EngineSettings().max_model_len, "--max-model-len", help="Longest sequence."),
    heartbeat_s: float = typer.Option(EngineSettings().heartbeat_interval_s, "--heartbeat-s", help="Heartbeat period."),
    stall_after_s: float = typer.Option(EngineSettings().stall_after_s, "--stall-after-s",
                                        help="Busy with one update or join longer than this: reported unhealthy."),
    work_dir: Path = typer.Option(Path(".run/engines"), "--work-dir", help="Where staged versions are downloaded."),
    config: Path | None = typer.Option(None, "--config", help="YAML run configuration."),
) -> None:
    """Serve a policy with vLLM; follow `weights` and publish heartbeats until SIGTERM.

    Example: rollstream engine --pool current --model .run/policy --port 8100 --run demo
    """
    if not (model / "config.json").is_file():
        typer.echo(f"rollstream engine: {model} is not a Hugging Face checkpoint (no config.json)", err=True)
        raise typer.Exit(code=2)
    settings = EngineSettings(pool=pool.value, stale_step=stale_step, max_model_len=max_model_len,
                              heartbeat_interval_s=heartbeat_s, stall_after_s=stall_after_s)
    cfg = load_config(config)
    run = run or cfg.run
    engine_id = engine_id or f"{pool.value}-{port}"
    # The supervisor probes and updates the server locally; others are told the advertised address.
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    on_gpu = _cuda_available()
    env = {**os.environ, INITIAL_VERSION_ENV: str(initial_version)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_space_gib))
    command = vllm_command(str(model), host=host, port=port, max_model_len=settings.max_model_len,
                           dtype="auto" if on_gpu else "float32", enforce_eager=not on_gpu,
                           chunked_prefill=on_gpu)
    # vLLM's own log goes to our stderr; the server gets its own session so SIGTERM reaches its children.
    server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr, env=env, start_new_session=True)
    # The server inherits this process's niceness (engines.nice) but leads a session of its own, where
    # the kernel schedules by session first: the session gets the same niceness, or the niceness counts for nothing.
    if niceness := os.getpriority(os.PRIO_PROCESS, 0):
        set_session_niceness(server.pid, niceness)
    stopping = {"flag": False}

    def request_stop(signum: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    producer: EventProducer | None = None
    consumer: EventConsumer | None = None
    heartbeat: Heartbeat | None = None
    try:
        start_s = wait_healthy(url, server, settings.start_timeout_s)
        _log(f"{engine_id} ({pool.value}) serving {model} at {url}, healthy after {start_s:.1f} s")
        mc = objectstore.client(cfg.object_store)
        producer = EventProducer(cfg.kafka, client_id=f"engine-{engine_id}")
        consumer = EventConsumer(cfg.kafka, f"rollstream-engine-{engine_id}", [topics.WEIGHTS],
                                 client_id=f"engine-{engine_id}", dlq=producer)
        control = EngineControl(url)
        follower = WeightFollower(consumer, mc, control, pool=pool.value, run=run, stale_step=settings.stale_step,
                                  download_root=work_dir / engine_id)
        heartbeat = Heartbeat(producer, engine_id=engine_id, run=run, pool=pool.value, url=advertise_url or url, model=str(model),
                              interval_s=settings.heartbeat_interval_s, probe_timeout_s=settings.probe_timeout_s,
                              initial_version=initial_version, stall_after_s=settings.stall_after_s,
                              extra_detail=lambda: follower.last_error)
        heartbeat.start()
        while not stopping["flag"] and server.poll() is None:
            follower.poll_once(1.0)
        if server.poll() is not None:
            _log(f"vLLM exited with code {server.returncode}")
    except RuntimeError as error:
        typer.echo(f"rollstream engine: {error}", err=True)
        raise typer.Exit(code=1) from None
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
            _log(f"{engine_id}: last events not delivered while stopping: {error}")
    if not stopping["flag"]:
        raise typer.Exit(code=1)


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


if __name__ == "__main__":
    app()
