"""`rollstream report`: rebuild a run's report folder from its topics alone (pipeline/analysis/run_report.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from pipeline.analysis.run_report import NoEvents, print_summary, write_report
from pipeline.cli.toolkit import App, ConfigOption, JsonOption, QuietOption, RunOption, fail
from pipeline.run.config import load_config


def report(
    run: RunOption,
    out: Path | None = typer.Option(None, help="Report folder (default runs/RUN)."),
    config: ConfigOption = None,
    since: str | None = typer.Option(None, "--from", help="Read from this ISO time or offset (default: the topics' start)."),
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Rebuild the report of a run (report.md, summary.json, PNG figures) from its topics alone:
    works on a live run, a finished one, and after the processes that wrote it are gone.

    Example:

        rollstream report --run r1 --out runs/r1 --json
    """
    cfg = load_config(config)
    out_dir = out if out is not None else cfg.run_dir(run)
    try:
        summary = write_report(cfg, run, out_dir, progress=not quiet and sys.stderr.isatty(),
                               show_config=config is not None, since=since)
    except (NoEvents, ValueError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        print_summary(summary, out_dir, Console())


app = App()
app.command()(report)
