"""`rollstream infra`: create the topics and buckets of infra/topics.yaml, and report their state
(pipeline/run/infra.py)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, JsonOption, fail
from pipeline.run import infra
from pipeline.run.config import load_config

app = App(name="infra", help="Local infrastructure: topics and buckets.", no_args_is_help=True)


@app.command("init")
def init(config: ConfigOption = None,
         wait_s: Annotated[float, typer.Option("--wait-s", min=0.1, help="How long to wait for Kafka and the object "
                                               "store to answer (they may be starting).")] = 60.0) -> None:
    """Waits for Kafka and the object store, then creates every missing topic and bucket.

    Example: rollstream infra init
    """
    cfg = load_config(config)
    try:
        done = infra.init(cfg, infra.load_spec(), wait_s)
    except infra.SpecMismatch as error:
        fail(str(error), CHECK_FAILED)
    for m in done.mismatched:
        typer.echo(f"[rollstream] warning: topic {m}", err=True)
    typer.echo(f"[rollstream] topics: {done.topics} ({len(done.created_topics)} created); "
               f"buckets: {done.buckets} ({len(done.created_buckets)} created)", err=True)
    for bucket, days, topic in done.expiry_changes:
        typer.echo(f"[rollstream] bucket {bucket}: objects now expire "
                   f"{'never' if days is None else f'after {days} days'} (topic {topic}'s retention)", err=True)


@app.command("status")
def status(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Shows every topic (partitions, settings) and bucket, and whether it exists.

    Example: rollstream infra status --json
    """
    info = infra.describe(load_config(config), infra.load_spec())
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Kafka {info['kafka']['bootstrap_servers']} ({info['kafka']['brokers']} broker)")
    for col in ("topic", "exists", "partitions", "cleanup", "compression", "max bytes", "retention ms"):
        table.add_column(col)
    for name, t in info["kafka"]["topics"].items():
        c = t["config"]
        table.add_row(name, str(t["exists"]), str(t["partitions"]), c.get("cleanup.policy", ""),
                      c.get("compression.type", ""), c.get("max.message.bytes", ""), c.get("retention.ms", ""))
    console = Console()
    console.print(table)
    for b, ok in info["object_store"]["buckets"].items():
        console.print(f"bucket {b}: {'exists' if ok else 'MISSING'}")
