"""`rollstream replay TOPIC` (decode a topic into Parquet or JSONL) and `rollstream replay verify`
(re-derive a run's advantages and token invariants from its events, pipeline/analysis/replay_verify.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from typer._click import Command, Context
from typer.core import TyperGroup

from pipeline.analysis.replay import (
    SUFFIXES,
    VERIFY_TOPICS,
    ReplayError,
    read_run,
    read_topic,
    store_fetch,
    write_records,
)
from pipeline.analysis.replay_records import Bound, ReplayStats
from pipeline.analysis.replay_verify import VerifyReport, VerifySettings, verify
from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, JsonOption, RunOption, fail
from pipeline.run.config import load_config
from schemas import topics
from streams.settings import StdKind

_TOPIC_COMMAND = "topic"


class _ReplayGroup(TyperGroup):
    """`replay verify ...` runs the verify subcommand; `replay TOPIC ...` (any other first word) runs
    the topic command under the name TOPIC, which it reads back from its context, so its usage line
    reads `rollstream replay TOPIC [OPTIONS]`. The topic command itself rejects an unknown topic."""

    def resolve_command(self, ctx: Context, args: list[str]) -> tuple[str | None, Command | None, list[str]]:
        if args and args[0] not in self.commands:
            return args[0], self.commands[_TOPIC_COMMAND], args[1:]
        return super().resolve_command(ctx, args)


app = App(name="replay", cls=_ReplayGroup, no_args_is_help=True, subcommand_metavar="TOPIC|verify [ARGS]...")


@app.callback()
def replay() -> None:
    """Decode a topic into Parquet or JSONL (rollstream replay TOPIC), or verify a run (rollstream replay verify).

    Examples:

        rollstream replay trajectories --run r1 --out trajectories.parquet

        rollstream replay verify --run r1 --json

    Columns of every topic: pipeline/analysis/REPLAY.md. `rollstream replay TOPIC --help` shows the options.
    """


def _bound(option: str, text: str | None) -> Bound | None:
    if text is None:
        return None
    try:
        return Bound.parse(text)
    except ValueError as e:
        fail(f"{option}: {e}")


class _Progress:
    """One progress bar on stderr of the records read, over one topic or several in turn; off when
    stderr is not a terminal (disable=None), so --json output and logs stay clean."""

    def __init__(self) -> None:
        self._bar = tqdm(unit=" records", file=sys.stderr, disable=None, leave=False)

    def __call__(self, topic: str, stats: ReplayStats) -> None:
        self._bar.set_description(topic, refresh=False)
        self._bar.total = stats.planned
        self._bar.update(stats.read - self._bar.n)

    def close(self) -> None:
        self._bar.close()


_TOPIC_HELP = f"""Decode TOPIC ({', '.join(topics.ALL_TOPICS)}) into flat, documented columns
(pipeline/analysis/REPLAY.md), ordered by (partition, offset).

Example:

    rollstream replay trajectories --run r1 --from 2025-01-01T12:00:00Z --out t.parquet --out t.jsonl
"""


@app.command(_TOPIC_COMMAND, hidden=True, help=_TOPIC_HELP)
def replay_topic(
    ctx: typer.Context,
    out: list[Path] = typer.Option(..., "--out", help="Output file, .parquet or .jsonl; repeat to write both."),
    run: str | None = typer.Option(None, help="Only events of this run (dead letters, and heartbeats of engines "
                                   "that name no run, carry none: all kept)."),
    start: str | None = typer.Option(None, "--from", help="First offset (in every partition) or ISO-8601 time, "
                                     "inclusive."),
    end: str | None = typer.Option(None, "--to", help="End offset (in every partition) or ISO-8601 time, exclusive."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    cfg = load_config(config)
    topic = ctx.info_name or ""
    if topic not in topics.EVENT_OF_TOPIC:
        fail(f"unknown topic {topic!r}; topics: {', '.join(topics.ALL_TOPICS)}")
    bad = [str(p) for p in out if p.suffix not in SUFFIXES]
    if bad:
        fail(f"--out must end in .parquet or .jsonl: {', '.join(bad)}")
    start_bound, end_bound = _bound("--from", start), _bound("--to", end)
    stats, progress = ReplayStats(), _Progress()
    # Claim-checked events (batches too large for one message) are read from the run's object store.
    records = read_topic(cfg.kafka, topic, run=run, start=start_bound, end=end_bound, stats=stats,
                         progress=partial(progress, topic), fetch=store_fetch(cfg.object_store))
    try:
        rows = write_records(records, topic, out)
    except ReplayError as e:
        fail(str(e), CHECK_FAILED)
    except OSError as e:
        fail(f"cannot write: {e}")
    finally:
        progress.close()
    _report_undecodable(stats)
    summary = {"topic": topic, "run": run, "rows": {str(p): rows for p in out}, "read": stats.read,
               "other_runs": stats.other_runs, "undecodable": stats.undecodable,
               "missing_payloads": [asdict(m) for m in stats.missing_payloads]}
    if as_json:
        typer.echo(json.dumps(summary))
        return
    for path in out:
        typer.echo(f"{path}: {rows} rows of {topic}")
    typer.echo(f"read {stats.read} records, {stats.other_runs} of other runs skipped, "
               f"{stats.undecodable} undecodable, {len(stats.missing_payloads)} without their stored payload")


def _report_missing_payloads(stats: ReplayStats) -> None:
    """One line on stderr per batch whose stored payload is gone: its row carries no items."""
    for m in stats.missing_payloads:
        typer.echo(f"payload gone: {m.topic}[{m.partition}]@{m.offset} batch {m.batch_id}: {m.uri} no longer "
                   "exists (expired or deleted); its items are unknown", err=True)


def _report_undecodable(stats: ReplayStats) -> None:
    _report_missing_payloads(stats)
    for u in stats.undecodable_examples:
        typer.echo(f"undecodable: {u.topic}[{u.partition}]@{u.offset}: {u.reason}", err=True)
    if stats.undecodable > len(stats.undecodable_examples):
        typer.echo(f"undecodable: {stats.undecodable - len(stats.undecodable_examples)} more", err=True)


@app.command("verify")
def replay_verify(
    run: RunOption,
    start: str | None = typer.Option(None, "--from", help="Read from this ISO-8601 time (or offset) instead of each "
                                     "topic's beginning: the run's start time spares reading older runs."),
    std: StdKind = typer.Option(VerifySettings().std, help="Std of GRPO and task normalization the run used."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Recompute a run's GRPO and task-normalized advantages and token invariants from its topics;
    print each check and every mismatch; exit 1 when there is any. Give the run's --config when it
    turned task normalization off (`streams.task_adv_norm: false`), scaled a family's advantages
    (`streams.task_advantage_scale`) or left the advantages to the learner (`streams.advantage: none`, SAO).

    Example:

        rollstream replay verify --run r1 --json
    """
    cfg = load_config(config)
    start_bound = _bound("--from", start)
    stats, progress = ReplayStats(), _Progress()
    try:
        records = read_run(cfg.kafka, run, VERIFY_TOPICS, start=start_bound, stats=stats, progress=progress,
                           fetch=store_fetch(cfg.object_store))
    except ReplayError as e:
        fail(str(e), CHECK_FAILED)
    finally:
        progress.close()
    _report_missing_payloads(stats)
    settings = VerifySettings(std=std, task_adv_norm=cfg.streams.task_adv_norm, advantage=cfg.streams.advantage,
                              task_advantage_scale=cfg.streams.task_advantage_scale)
    report = verify(records, settings, run=run, undecodable=stats.undecodable_by_topic)
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
    else:
        _print(report)
    if not report.ok:
        raise typer.Exit(code=CHECK_FAILED)


def _print(report: VerifyReport) -> None:
    console = Console(file=sys.stdout, width=120, highlight=False)
    table = Table(title=f"rollstream replay verify --run {report.run}")
    for name in ("check", "checked", "mismatches"):
        table.add_column(name, justify="left" if name == "check" else "right")
    for c in report.checks:
        table.add_row(c.name, str(c.checked), str(len(c.mismatches)))
    console.print(table)
    for c in report.checks:
        for m in c.mismatches:
            ids = " ".join(f"{k}={v}" for k, v in m.ids.items())
            console.print(f"MISMATCH {c.name}: {ids} {m.detail}", markup=False, soft_wrap=True)
    console.print("events: " + ", ".join(f"{t} {n}" for t, n in report.counts.items()), markup=False)
    console.print(f"dead letters: {report.dead_letters['run']} of this run, {report.dead_letters['total']} in all; "
                  f"undecodable (any run, named by `rollstream replay TOPIC`): {sum(report.undecodable.values())}",
                  markup=False)
    console.print(f"pending groups (run ended before they trained): {len(report.pending_groups)}", markup=False)
    for what, n in report.not_checked.items():
        console.print(f"not checked: {n} {what.replace('_', ' ')}", markup=False)
    console.print("clean: no mismatch" if report.ok else f"{report.mismatches} mismatches", markup=False)
