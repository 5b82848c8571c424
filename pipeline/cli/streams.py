"""`rollstream streams worker`: run the Faust stream processor (router, aggregator, batcher, metrics).

Composes StreamsSettings (the pure logic's settings) and WorkerSettings (how this process runs)
from the options; the broker comes from the run configuration (pipeline/run/config.py).
"""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError

from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, SettingsOption, fail
from pipeline.run.config import load_config, validation_message
from streams.app import COMPONENTS
from streams.settings import StdKind, StreamsSettings, WorkerSettings
from streams.worker import PartitionsMismatch, run_worker

app = App(name="streams", no_args_is_help=True, help="The Faust stream processor.")

_S = StreamsSettings()
_W = WorkerSettings()


@app.callback()
def streams() -> None:
    """The Faust stream processor: router, group aggregator, batcher, metrics."""


def build_settings(**fields: object) -> StreamsSettings:
    """StreamsSettings from the given fields; a one-line user error when they do not validate."""
    try:
        return StreamsSettings(**fields)
    except ValidationError as e:
        fail(validation_message(e))


@app.command("worker")
def worker(
    app_id: str = typer.Option(_W.app_id, help="Faust app id: consumer group, internal topics, changelogs."),
    config: ConfigOption = None,
    datadir: Path = typer.Option(_W.datadir, help="Faust data directory."),
    components: str = typer.Option(",".join(COMPONENTS), help="Comma-separated jobs to run here."),
    web_port: int = typer.Option(_W.web_port, help="Port of the JSON metrics view."),
    no_web: bool = typer.Option(False, "--no-web", help="Do not serve the metrics view."),
    metrics_port: int | None = typer.Option(_W.metrics_port, min=0, max=65535, help="Serve Prometheus metrics on "
                                            "this port, 0 any free one (default none)."),
    metrics_host: str = typer.Option(_W.metrics_host, help="Address the metrics bind: 0.0.0.0 for a scraper on "
                                     "another host (default loopback)."),
    sweep_interval_s: float = typer.Option(_W.sweep_interval_s, help="Aggregator sweep period."),
    metrics_interval_s: float = typer.Option(_W.metrics_interval_s, help="Metrics publishing period."),
    group_size: int = typer.Option(_S.group_size, help="Rollouts per sample, n."),
    batch_size: int = typer.Option(_S.batch_size, help="Groups per training batch."),
    first_batch_factor: float = typer.Option(_S.first_batch_factor, help="The first batch waits for this x min."),
    min_members: int = typer.Option(_S.min_members, help="Fewest unmasked members a masked/timed-out group trains with."),
    group_timeout_s: float = typer.Option(_S.group_timeout_s, help="A group incomplete this long is closed."),
    std: StdKind = typer.Option(_S.std, help="bessel or population."),
    from_now: bool = typer.Option(False, "--from-now", help="A new app id skips the history of the data topics."),
    loglevel: str = typer.Option("WARNING", help="Log level of the worker."),
    run: str | None = typer.Option(None, "--run", help="Serve only this run's events (default: every run)."),
    settings_file: SettingsOption = None,
    batch_offload_bytes: int = typer.Option(_W.batch_offload_bytes, help="An encoded batch above this size goes to "
                                            "the object store (claim check)."),
) -> None:
    """Run one streams worker until SIGTERM; more workers with the same --app-id share the work.

    Example:

        rollstream streams worker --app-id rollstream-streams --batch-size 256 --web-port 6066
    """
    loaded = load_config(config)
    chosen = [c.strip() for c in components.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(COMPONENTS))
    if unknown or not chosen:
        fail(f"unknown components {unknown}; choose from {', '.join(COMPONENTS)}")
    if settings_file is not None:
        try:
            settings = StreamsSettings.model_validate_json(settings_file.read_text())
        except (OSError, ValidationError) as e:
            fail(f"--settings {settings_file}: {validation_message(e) if isinstance(e, ValidationError) else e}")
    else:
        settings = build_settings(group_size=group_size, batch_size=batch_size, first_batch_factor=first_batch_factor,
                                  min_members=min_members, group_timeout_s=group_timeout_s, std=std)
    try:
        worker_settings = WorkerSettings(app_id=app_id, run=run, datadir=datadir, web_port=web_port,
                                         web_enabled=not no_web, metrics_port=metrics_port, metrics_host=metrics_host,
                                         sweep_interval_s=sweep_interval_s, metrics_interval_s=metrics_interval_s,
                                         batch_offload_bytes=batch_offload_bytes)
    except ValidationError as e:
        fail(validation_message(e))
    try:
        run_worker(loaded.kafka, settings, worker_settings, chosen, loglevel, from_now=from_now,
                   store=loaded.object_store)
    except PartitionsMismatch as e:
        fail(str(e), CHECK_FAILED)


if __name__ == "__main__":
    app()
