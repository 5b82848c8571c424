"""One recording-proxy process (env_workers/proxy.py, env_workers/proxy_server.py) with its tokenizer, engine
pool, Kafka producer and the engines' heartbeats: what `rollstream proxy` runs once its options are parsed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from confluent_kafka import OFFSET_BEGINNING
from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engines import EnginePool, sampling_key
from env_workers.envs import registry
from env_workers.proxy import Episode, Episodes
from env_workers.proxy_server import make_app
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from schemas import topics
from schemas.bus import EventConsumer, EventProducer
from schemas.prometheus import reachable_host
from schemas.settings import KafkaSettings

SERVICE_INTERVAL_S = 0.05
"""How often the producer's delivery reports and the engines' heartbeats are served (as the env worker's loop)."""


async def serve(settings: ProxySettings, loop_settings: AgentLoopSettings, kafka: KafkaSettings, model: Path, run: str,
                *, seed: int = 0, engine_urls: dict[str, list[str]] | None = None, served_name: str | None = None,
                on_ready: Callable[[str], None] | None = None, stop: asyncio.Event | None = None) -> dict[str, int]:
    """Serves the proxy until SIGTERM/SIGINT (or `stop`); the episodes' counts. Engines are the static
    `engine_urls` ({pool: [url]}, served model `served_name`), else those the `engines` heartbeats announce.
    `on_ready` gets the base URL once the server listens."""
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
    engines = EnginePool(run=run, stop_token_ids=[encoder.eos_token_id], clock_ms=lambda: int(time.time() * 1000),
                         heartbeat_timeout_s=settings.heartbeat_timeout_s,
                         failure_backoff_s=settings.engine_failure_backoff_s,
                         timeout_s=loop_settings.engine_timeout_s, api_key=loop_settings.engine_api_key)
    producer = EventProducer(kafka, client_id=settings.worker_id)
    heartbeats: EventConsumer | None = None
    if engine_urls:
        engines.add_static(engine_urls, served_name or "")
    else:  # every heartbeat of the compacted topic, outside any group, as the env worker reads them
        heartbeats = EventConsumer(kafka, f"{settings.worker_id}-engines", [], client_id=f"{settings.worker_id}-engines",
                                   dlq=producer)
        heartbeats.assign({topics.ENGINES: {p: OFFSET_BEGINNING for p in heartbeats.end_offsets(topics.ENGINES)}})

    def publish_step(step: dict[str, Any]) -> None:
        producer.send(topics.STEPS, step, key=step["group_id"])

    def publish_trajectory(trajectory: dict[str, Any]) -> None:
        producer.send(topics.TRAJECTORIES, trajectory, key=trajectory["group_id"])

    def make_episode(request: dict[str, Any]) -> Episode:
        pick = engines.for_trajectory(sampling_key(seed, request), seeded=True)
        return Episode(request, encoder, pick, settings, loop_settings, clock=time.time, sleep=asyncio.sleep,
                       on_step=publish_step)

    episodes = Episodes(run=run, families=registry.family_names(), make_episode=make_episode, settings=settings,
                        on_trajectory=publish_trajectory)
    # The flush blocks (up to the broker's acknowledgement): in a thread, so other episodes' calls go on.
    app = make_app(episodes, model=settings.served_model_name, clock=time.time,
                   flush=lambda: asyncio.to_thread(producer.flush, 30.0))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread (a test's own loop)
            loop.add_signal_handler(signum, stop.set)
    if on_ready is not None:
        on_ready(f"http://{reachable_host(settings.host)}:{port}")
    try:
        while not stop.is_set():
            producer.poll(0)
            if heartbeats is not None:
                for _ in range(100):
                    event = heartbeats.poll(0)
                    if event is None:
                        break
                    engines.update(event.value)
            await asyncio.sleep(SERVICE_INTERVAL_S)
    finally:
        await runner.cleanup()
        producer.flush(30.0)
        if heartbeats is not None:
            heartbeats.close()
        await engines.aclose()
    return dict(episodes.counts)
