"""`rollstream dispatch`: run the dispatcher for one run (pipeline/dispatch/dispatcher.py)."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from pipeline.dispatch.dispatcher import run_dispatcher
from pipeline.dispatch.logic import DispatcherSettings, TaskSource
from pipeline.policy.sft import EVAL_SPLITS as HELD_OUT_SPLITS
from pipeline.policy.sft import TRAIN_SPLITS as TRAINING_SPLITS
from pipeline.run.config import load_config

_D = DispatcherSettings(sources=(TaskSource(task="calc", split="train", count=1),))


def _fail(message: str) -> NoReturn:
    typer.echo(f"rollstream dispatch: {message}", err=True)
    raise typer.Exit(code=1)


def parse_limit(text: str | None) -> int | dict[str, int] | None:
    """"6" -> 6 for every family; "calc=32,os=6" -> per family (others: all samples)."""
    if not text:
        return None
    if text.strip().isdigit():
        return int(text)
    limits = {}
    for item in text.split(","):
        name, sep, count = item.strip().partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"sample counts are N or FAMILY=N,...; got {item!r}")
        limits[name.strip()] = int(count)
    return limits


def parse_sources(spec: str, default_split: str | dict[str, str],
                  limit: int | dict[str, int] | None = None,
                  weights: dict[str, int] | None = None, envs: EnvSettings | None = None) -> tuple[TaskSource, ...]:
    """"calc,db:standard" -> one TaskSource per family (split after ':', else default_split, one
    name or one per family), with the split's sample count from the environment registry, at most `limit`,
    and its round-robin weight from `weights` (default 1)."""
    weights = weights or {}
    sources = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, split = item.partition(":")
        split = split or (default_split if isinstance(default_split, str) else default_split.get(name, ""))
        try:
            splits = registry.split_names(name)
            if split not in splits:
                _fail(f"family {name!r} has no split {split!r}; splits: {', '.join(splits)}")
            count = len(registry.samples(name, split, envs or load_config().envs))
        except registry.UnknownFamily as e:
            _fail(str(e))
        if count == 0:
            _fail(f"family {name!r} split {split!r} has no samples")
        cap = limit.get(name) if isinstance(limit, dict) else limit
        sources.append(TaskSource(task=name, split=split, count=min(count, cap) if cap else count,
                                  weight=weights.get(name, 1)))
    unknown = sorted(set(weights) - {source.task for source in sources})
    if unknown:
        _fail(f"weights name families that are not trained: {', '.join(unknown)}")
    return tuple(sources)


def _weights(text: str) -> dict[str, int]:
    parsed = parse_limit(text)
    if isinstance(parsed, int):
        _fail(f"--weights are FAMILY=N,...; got {text!r}")
    return parsed or {}


def dispatch(
    run: str = typer.Option(..., help="Run id stamped on every request."),
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
    config: Path | None = typer.Option(None, help="YAML run configuration (the broker, and `envs`, whose counts size "
                                       "the splits)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary on stdout."),
) -> None:
    """Dispatch task groups for a run, keeping at most --max-in-flight groups untrained; a restart
    resumes from what tasks.requested already holds.

    Example:

        rollstream dispatch --run r1 --families calc,db:standard --max-groups 512 --batch-size 32
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = load_config(config)
        envs = cfg.envs  # the file's: a count such as envs.calc_rl_tasks sizes a split
        settings = DispatcherSettings(
            sources=parse_sources(families, split or TRAINING_SPLITS, weights=_weights(weights), envs=envs),
            validation_sources=parse_sources(val_families, HELD_OUT_SPLITS, parse_limit(val_samples),
                                             envs=envs) if val_families else (),
            group_size=group_size, batch_size=batch_size, max_in_flight_groups=max_in_flight,
            val_interval=val_interval, val_group_size=val_group_size, val_before_train=not no_val_before_train)
    except ValidationError as e:
        _fail("; ".join(err["msg"] for err in e.errors()))
    except ValueError as e:
        _fail(str(e))
    if not settings.sources:
        _fail("--families names no family")
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


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(dispatch)
