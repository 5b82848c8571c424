"""`rollstream proxy`: the recording proxy (pipeline/run/proxy.py; the protocol: env_workers/proxy.py)."""

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

from env_workers.engine_client import served_model
from env_workers.proxy_settings import ProxySettings
from pipeline.cli.env_worker import policy_engines
from pipeline.cli.toolkit import ConfigOption, JsonOption, RunOption, fail
from pipeline.run.config import load_config, validation_message
from pipeline.run.proxy import serve


def proxy(
    run: RunOption,
    model: Path | None = typer.Option(None, "--model", help="The policy's checkpoint directory, for its tokenizer "
                                                             "(default: the configuration's policy.path)."),
    host: str | None = typer.Option(None, "--host", help="Address to bind (default: proxy.host, loopback)."),
    port: int | None = typer.Option(None, "--port", min=0, max=65535, help="Port (default: proxy.port; 0 any free one)."),
    reencode_mismatch: str | None = typer.Option(None, "--reencode-mismatch",
                                                 help="prefix or drop (default: proxy.reencode_mismatch)."),
    engine: list[str] = typer.Option([], "--engine", help="Static engine as POOL=URL (repeatable); none = from "
                                                          "`engines` heartbeats."),
    config_path: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Serve OpenAI chat completions for agents of one's own, recording every call as the run's steps and
    trajectories (open an episode, point the client at it, post its reward).

    Example: rollstream proxy --run r1 --port 8300 --json, then in the agent:
    OpenAI(base_url="http://127.0.0.1:8300/episodes/EPISODE_ID/v1", api_key="-")
    """
    config = load_config(config_path)
    model = model or config.policy.path
    engine_urls = policy_engines(model, engine)
    overrides = {k: v for k, v in (("host", host), ("port", port), ("reencode_mismatch", reencode_mismatch)) if v is not None}
    try:
        settings = ProxySettings.model_validate({
            **config.proxy.model_dump(), **overrides,
            "worker_id": f"{config.proxy.worker_id}-{socket.gethostname()}-{os.getpid()}"})
    except ValidationError as error:
        fail(validation_message(error))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    served = None
    if engine_urls:
        first = next(iter(engine_urls.values()))[0]
        try:
            served = served_model(first, config.agent_loop.engine_api_key)
        except Exception as error:  # noqa: BLE001: any failure to ask is one line
            fail(f"cannot ask {first} for its model: {error}")

    def ready(url: str) -> None:  # on stderr: stdout holds only the one JSON summary of --json
        typer.echo(f"proxy for run {run} serving on {url} (episodes: POST {url}/episodes)", err=True)

    counts = asyncio.run(serve(settings, config.agent_loop, config.kafka, model, run, seed=config.seed,
                               engine_urls=engine_urls, served_name=served, on_ready=ready))
    typer.echo(json.dumps(counts) if as_json else
               f"{counts['published']} trajectories published ({counts['dropped']} dropped), "
               f"{counts['cancelled']} episodes cancelled")
