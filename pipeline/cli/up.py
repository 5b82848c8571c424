"""`rollstream up`: train, validate and report one run (pipeline/run/up.py), then stop everything."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console

from pipeline.cli.toolkit import CHECK_FAILED, INTERRUPTED, ConfigOption, JsonOption, fail
from pipeline.run.config import RollstreamConfig, load_config, validation_message
from pipeline.run.up import STOPPED_BY_ALERT, RunFailed, default_run_id, run_up, summary_json


def _config(path: Path | None, max_steps: int | None) -> RollstreamConfig:
    cfg = load_config(path)
    if max_steps is None:
        return cfg
    try:
        return cfg.replaced(max_steps=max_steps)
    except ValidationError as e:
        fail(f"--max-steps {max_steps}: {validation_message(e)}")


def up(
    config: ConfigOption = None,
    run: str = typer.Option("", "--run", help="Run id (default: run-<date>-<time>); a new id starts a new run."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Override the configured learner steps."),
    report: bool = typer.Option(True, "--report/--no-report", help="Build runs/<run>/ report at the end."),
    live: bool = typer.Option(True, "--live/--no-live", help="Live progress screen on stderr."),
    as_json: JsonOption = False,
) -> None:
    """Train one run end to end: policy, engines, Faust worker, env workers, learner, dispatcher;
    live progress; final validation; the report; then everything stopped (also on Ctrl-C, exit 130,
    and on an alert rule with action stop, exit 1).

    Example: rollstream up --config configs/cpu.yaml
    """
    cfg = _config(config, max_steps)
    run = run or default_run_id()
    console = Console(stderr=True)
    try:
        summary = run_up(cfg, run, console=console, live=live and sys.stderr.isatty())
    except RunFailed as error:
        fail(f"run {run} failed: {error}", CHECK_FAILED)
    if report:
        from pipeline.analysis.run_report import NoEvents, print_summary, write_report  # matplotlib only for a report

        try:
            report_summary = write_report(cfg, run, Path(summary["run_dir"]), since=summary["started_at"])
        except NoEvents as error:
            console.print(f"no report: {error}")
        else:
            summary["report"] = {"folder": summary["run_dir"], **report_summary}
            if not as_json:
                print_summary(report_summary, Path(summary["run_dir"]), Console())
    if as_json:
        typer.echo(summary_json(summary))
    else:
        console.print(f"run {run}: {summary['outcome']} in {summary['duration_s']:.0f} s; folder {summary['run_dir']}")
    if summary["outcome"] == "interrupted":
        raise typer.Exit(code=INTERRUPTED)
    if summary["outcome"].startswith(STOPPED_BY_ALERT):  # the run did not reach max_steps: scripts must see it
        raise typer.Exit(code=CHECK_FAILED)
