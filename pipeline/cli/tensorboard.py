"""`rollstream tensorboard`: a run's `metrics` events written as TensorBoard scalars, live
(pipeline/analysis/tensorboard.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import typer

from pipeline.analysis.tensorboard import TensorboardError, export_run
from pipeline.cli.toolkit import CHECK_FAILED, ConfigOption, JsonOption, QuietOption, fail
from pipeline.run.config import load_config


def tensorboard(
    run: str = typer.Option(..., "--run", help="Run whose metrics to write."),
    logdir: Path | None = typer.Option(None, "--logdir", help="Folder of the event files (default: "
                                       "runs/RUN/tensorboard)."),
    from_beginning: bool = typer.Option(True, "--from-beginning/--follow",
                                        help="The run's whole history first (its earlier event files in the "
                                             "folder are replaced), or only what arrives from now on."),
    until_idle: float | None = typer.Option(None, "--until-idle", min=0.0, help="Stop once this many seconds "
                                            "pass without an event of the run, 0 once its history is written "
                                            "(default: run until Ctrl-C)."),
    config: ConfigOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Write a run's metrics (learner loss, KL, clip fraction, success per task, throughput, staleness, ...) as
    TensorBoard scalars under runs/RUN/tensorboard as they arrive; Ctrl-C stops it and prints the summary.

    Example: rollstream tensorboard --run r1, then tensorboard --logdir runs/r1/tensorboard
    """
    cfg = load_config(config)
    folder = logdir if logdir is not None else cfg.run_dir(run) / "tensorboard"
    stop = {"requested": False}

    def request_stop(*_: object) -> None:
        stop["requested"] = True  # the normal end of a follower: flush, close, summarize

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    say = (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True))
    say(f"writing run {run}'s metrics to {folder} ({'from the beginning' if from_beginning else 'from now on'}); "
        f"{'Ctrl-C stops' if until_idle is None else f'stops after {until_idle:g} s without an event'}")
    try:
        stats = export_run(cfg.kafka, run, folder, from_beginning=from_beginning, until_idle_s=until_idle,
                           should_stop=lambda: stop["requested"], progress=say)
    except TensorboardError as error:
        fail(str(error), CHECK_FAILED)
    except OSError as error:
        fail(f"cannot write {folder}: {error}")
    summary = stats.summary(run)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"{folder}: {summary['scalars']} scalars under {summary['tags']} tags from {summary['events']} "
                   f"events of run {run}; view them with: tensorboard --logdir {folder}")
