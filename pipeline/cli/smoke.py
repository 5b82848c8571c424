"""`rollstream smoke`: the platform check.

Starts nothing itself (the infrastructure must be up: `make infra-up`); sends one example event of
every type through its real topic, reads each back through the codec, round-trips an object
through the object store (pipeline/run/smoke.py), and says plainly which parts of rollstream are
not built yet.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from pipeline.cli.toolkit import CHECK_FAILED, ConfigOption, JsonOption, fail
from pipeline.run.config import load_config
from pipeline.run.smoke import run_smoke
from schemas import topics


def smoke(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Sends one event of every type through the real broker and reads it back; checks the object store.

    Example: rollstream smoke --json
    """
    out = run_smoke(load_config(config))
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        console = Console()
        table = Table(title="One event of every type through Kafka")
        for col in ("topic", "event", "decoded equal", "partition", "offset", "latency ms"):
            table.add_column(col)
        for topic in topics.ALL_TOPICS:
            r = out["topics"].get(topic)
            table.add_row(topic, topics.EVENT_OF_TOPIC[topic], *(["MISSING", "", "", ""] if r is None else
                          [str(r["equal"]), str(r["partition"]), str(r["offset"]), str(r["latency_ms"])]))
        console.print(table)
        console.print(f"object store round trip: {'ok' if out['object_store_round_trip'] else 'FAILED'}")
        console.print("\n[bold]Not built yet[/bold]:")
        for item in out["not_built"]:
            console.print(f"  - {item['part']} (issue #{item['issue']})")
    if not out["ok"]:
        fail("FAILED: see above", CHECK_FAILED)
