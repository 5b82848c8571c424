"""`rollstream dispatch`: run the dispatcher for one run (pipeline/dispatch/dispatcher.py)."""

from __future__ import annotations

import json
import logging
import signal
import sys

import typer
from pydantic import ValidationError

from pipeline.cli.toolkit import App, ConfigOption, JsonOption, RunOption, fail
from pipeline.dispatch.dispatcher import run_dispatcher
from pipeline.dispatch.logic import DispatcherSettings, TaskSource
from pipeline.dispatch.sources import parse_limit, parse_sources, parse_weights
from pipeline.policy.splits import EVAL_SPLITS as HELD_OUT_SPLITS
from pipeline.policy.splits import TRAIN_SPLITS as TRAINING_SPLITS
from pipeline.run.config import load_config

_D = DispatcherSettings(sources=(TaskSource(task="calc", split="train", count=1),))


def dispatch(
    run: RunOption,
    families: str = typer.Option(..., help="Training families, interleaved in this order; FAMILY[:SPLIT]."),
    weights: str = typer.Option("", help="Groups per round-robin turn, FAMILY=N,... (default 1 each, as AgentRL)."),
    max_groups: int = typer.Option(..., min=1, help="Stop once the run holds this many training groups."),
    split: str = typer.Option("", help="Split of a family given without one (default: the family's training split)."),
    val_families: str = typer.Option("", help="Validation families, FAMILY[:SPLIT] (default: the family's held-out split)."),
    group_size: int = typer.Option(_D.group_size, help="Rollouts per training sample, n."),
    batch_size: int = typer.Option(_D.batch_size, help="Groups per training batch (sets the default in-flight bound)."),
    max_in_flight: int | None = typer.Option(None, min=1, help="Groups in flight at most (default 2 x batch size)."),
    val_interval: int = typer.Option(_D.val_interval, help="Validate every this many learner versions."),
    val_group_size: int = typer.Option(_D.val_group_size, help="Rollouts per validation sample."),
    val_samples: str = typer.Option("", help="Validation samples per family, the first ones: N, or FAMILY=N,... (default all)."),
    no_val_before_train: bool = typer.Option(False, "--no-val-before-train", help="Skip validation round 0."),
    poll_s: float = typer.Option(1.0, help="How long each progress poll waits."),
    metrics_port: int | None = typer.Option(None, min=0, max=65535, help="Serve Prometheus metrics on this port, "
                                            "0 any free one (default none)."),
    metrics_host: str = typer.Option(_D.metrics_host, help="Address the metrics bind: 0.0.0.0 for a scraper on "
                                     "another host (default loopback)."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Dispatch task groups for a run, keeping at most --max-in-flight groups untrained; a restart
    resumes from what tasks.requested already holds.

    Example:

        rollstream dispatch --run r1 --families calc,db:standard --max-groups 512 --batch-size 32
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config(config)
    envs = cfg.envs  # the file's: a count such as envs.calc_rl_tasks sizes a split
    try:
        settings = DispatcherSettings(
            sources=parse_sources(families, split or TRAINING_SPLITS, weights=parse_weights(weights), envs=envs),
            validation_sources=parse_sources(val_families, HELD_OUT_SPLITS, parse_limit(val_samples),
                                             envs=envs) if val_families else (),
            group_size=group_size, batch_size=batch_size, max_in_flight_groups=max_in_flight,
            val_interval=val_interval, val_group_size=val_group_size, val_before_train=not no_val_before_train,
            seed=cfg.seed,  # the run seed: the configuration's (`up` passes the whole of it)
            metrics_port=metrics_port, metrics_host=metrics_host)
    except ValidationError as e:
        fail("; ".join(err["msg"] for err in e.errors()))
    except ValueError as e:
        fail(str(e))
    if not settings.sources:
        fail("--families names no family")
    stop = {"requested": False}

    def request_stop(*_: object) -> None:
        stop["requested"] = True  # finish the plan in progress (its requests flushed), then exit

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    summary = run_dispatcher(cfg.kafka, run, settings, max_groups, poll_s=poll_s,
                             should_stop=lambda: stop["requested"])
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"run {run}: {summary['dispatched_groups']} groups dispatched now, {summary['total_groups']} in all "
                   f"(resumed at position {summary['resumed_at_position']}); validation rounds "
                   f"{summary['validation_rounds'] or 'none'}")


app = App()
app.command()(dispatch)


if __name__ == "__main__":
    app()
