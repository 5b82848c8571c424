"""One env-worker process (env_workers/worker.py) with its tokenizer, engine pool and signals: what
`rollstream env-worker` runs once its options are parsed."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import served_model
from env_workers.engines import EnginePool
from env_workers.worker import PROMETHEUS, EnvWorker, WorkerStats
from env_workers.worker_settings import EnvWorkerSettings
from schemas.prometheus import serve_metrics
from schemas.settings import KafkaSettings


async def serve(settings: EnvWorkerSettings, kafka: KafkaSettings, model: Path, run: str, worker_id: str) -> WorkerStats:
    """Rolls out the run's tasks until SIGTERM/SIGINT, then drains; raises WorkerFailed on a fatal error.
    The engines are the settings' static ones, or else those the `engines` heartbeats announce."""
    serve_metrics(settings.metrics_port, worker_id, PROMETHEUS, host=settings.metrics_host)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
    engines = EnginePool(run=run, stop_token_ids=[encoder.eos_token_id], clock_ms=lambda: int(time.time() * 1000),
                         heartbeat_timeout_s=settings.heartbeat_timeout_s,
                         failure_backoff_s=settings.engine_failure_backoff_s,
                         timeout_s=settings.agent_loop.engine_timeout_s, api_key=settings.agent_loop.engine_api_key)
    if settings.engine_urls:
        first = next(iter(settings.engine_urls.values()))[0]
        engines.add_static(settings.engine_urls, settings.model or served_model(first, settings.agent_loop.engine_api_key))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    worker = EnvWorker(settings, kafka, encoder, engines, run=run, worker_id=worker_id)
    try:
        return await worker.run(stop)
    finally:
        await engines.aclose()
