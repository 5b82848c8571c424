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
    wait: bool = typer.Option(False, "--wait", help="First wait until the run has ended: its learner at max_steps "
                              "and the final validation round complete (a deployment's report job)."),
    wait_timeout_s: float = typer.Option(86_400.0, min=1, help="With --wait: give up after this many seconds."),
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
    if wait:
        from pipeline.run.follower import wait_for_run_end
        from pipeline.run.plan import final_validation_round

        say = (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True))
        if not wait_for_run_end(cfg.kafka, run, cfg.max_steps, final_validation_round(cfg), wait_timeout_s, say):
            fail(f"run {run} did not end within {wait_timeout_s:.0f} s")
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
