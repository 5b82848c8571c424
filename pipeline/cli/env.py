"""`rollstream env`: commands about the task environments.

Families are found through env_workers.envs.registry, so a new family needs no change here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.envs.check import check_family
from pipeline.cli.toolkit import App, ConfigOption, JsonOption, QuietOption, fail
from pipeline.run.config import load_config

app = App(name="env", help="Task environments: checks of their data and graders.", no_args_is_help=True)


@app.callback()
def env() -> None:
    """Task environments: checks of their data and graders."""


def _samples(name: str, data: Path | None, split: str | None, settings: EnvSettings) -> list[dict[str, Any]]:
    if (data is None) == (split is None):
        fail("give exactly one of --data PATH or --split NAME")
    try:
        family = registry.family(name)
        if data is not None:
            if not data.exists():
                fail(f"no such data file: {data}")
            try:
                return family.load(data)
            except (OSError, ValueError, KeyError, TypeError) as error:
                fail(f"cannot read {data} as {name} data: {error!r}")
        return list(registry.samples(name, split, settings))
    except registry.UnknownFamily as error:
        fail(str(error))
    raise AssertionError("unreachable")


def _print_table(result: dict[str, Any]) -> None:
    columns = ("tasks", "golden_pass", "noop_pass", "errors")
    table = Table(title=f"env check: {result['family']}")
    variants = result.get("variants", {})
    if variants:  # one row per kind of variant (os_variants.py), then the total
        table.add_column("variant")
    for column in columns:
        table.add_column(column, justify="right")
    for kind, counts in variants.items():
        table.add_row(kind, *(str(counts[c]) for c in columns))
    table.add_row(*(["all"] if variants else []), *(str(result[c]) for c in columns))
    console = Console()
    console.print(table)
    failing = result["failing_ids"]
    console.print(f"unfit for training ({len(failing)}): {', '.join(failing) if failing else 'none'}")


@app.command("check")
def check(
    family: str = typer.Option(..., "--family", help="Task family: calc, db, kg, os, ..."),
    data: Path | None = typer.Option(None, "--data", help="A data file in the family's shipped format."),
    split: str | None = typer.Option(None, "--split", help="A registry split instead of a file (e.g. calc's dev)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Check only the first N tasks."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Runs every task twice through the environment API, golden and no-op; reports unfit tasks.

    Example: rollstream env check --family db --data ../shared/data/agentbench/dbbench/dev.jsonl --json
    """
    settings = load_config(config).envs
    samples = _samples(family, data, split, settings)[:limit]
    spec = registry.family(family)
    env = spec.make(settings)
    show_progress = not quiet and sys.stderr.isatty()
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        bar = progress.add_task(f"{family}: golden and no-op", total=len(samples))
        result = asyncio.run(check_family(spec, env, samples, on_task=lambda: progress.advance(bar)))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_table(result)
