"""A run's report from its topics alone: which topics it reads, reading them, and the summary's
human view (pipeline/analysis/report.py builds the report itself). Used by `rollstream report` and
at the end of `rollstream up`."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.analysis.report import build_report, format_change
from pipeline.run.config import RollstreamConfig
from schemas import topics

# What the report reads; engines, tasks and dlq add nothing to it.
REPORT_TOPICS = (topics.TRAJECTORIES, topics.STEPS, topics.GROUPS, topics.BATCHES, topics.WEIGHTS,
                 topics.METRICS, topics.TASKS_REQUESTED, topics.ALERTS)


class NoEvents(ValueError):
    """The run has no events to report on."""


def events_from_records(records: Mapping[str, Iterable[Any]]) -> dict[str, list[dict[str, Any]]]:
    """topic -> event dicts: each replayed record's decoded value plus its Kafka `_timestamp_ms`."""
    return {topic: [{**r.value, "_timestamp_ms": r.timestamp_ms} for r in recs] for topic, recs in records.items()}


def _ci(p: Mapping[str, Any] | None) -> str:
    if p is None:
        return "—"
    return (f"r{p['round']}: {p['successes']}/{p['episodes']} = {100 * p['rate']:.1f}% "
            f"[{100 * p['ci95'][0]:.1f}, {100 * p['ci95'][1]:.1f}]")


def _change(change: Mapping[str, Any] | None) -> str:
    return "—" if change is None else f"{format_change(change)} ({change['samples']} samples)"


def print_summary(summary: Mapping[str, Any], out_dir: Path, console: Console) -> None:
    """The human view of summary.json: run facts, then held-out success per task."""
    console.print(f"run {summary['run']}: {summary['duration_s']:.0f} s, {summary['learner_steps']} learner steps, "
                  f"{summary['trajectories']} trajectories; report in {out_dir}")
    table = Table("task", "before (round: successes/episodes = rate [95% CI])", "after",
                  "change, paired per sample [95% CI]", "verdict",
                  title="Held-out success, first vs last validation round")
    for task, row in summary["tasks"].items():
        table.add_row(task, _ci(row["before"]), _ci(row["after"]), _change(row.get("change")), row["verdict"])
    console.print(table)
    alerts = summary.get("alerts") or {}
    if alerts.get("events"):
        ended = "; stopped by " + alerts["stopped_by"] if alerts["stopped_by"] else (
            "; ended paused by " + alerts["paused_by"] if alerts["paused_by"] else "")
        console.print(f"alerts: {len(alerts['events'])} (report.md \"Alerts\"){ended}")


def write_report(cfg: RollstreamConfig, run: str, out_dir: Path, *, progress: bool = False,
                 show_config: bool = True, since: str | None = None) -> dict[str, Any]:
    """Reads the run's topics (from `since`, an ISO time or offset, when given: topics shared by many
    runs are long) and builds its report in out_dir; returns summary.json's content."""
    from pipeline.analysis.replay import (  # lazily: Kafka clients load only when a report is built
        Bound,
        ReplayError,
        read_topic,
    )

    start = Bound.parse(since) if since else None
    records = {}
    for topic in REPORT_TOPICS:
        try:
            records[topic] = list(read_topic(cfg.kafka, topic, run=run, start=start))
        except ReplayError as e:
            raise NoEvents(str(e)) from None
        if progress:
            print(f"{topic}: {len(records[topic])} events of run {run}", file=sys.stderr)
    events = events_from_records(records)
    if not any(events.values()):
        raise NoEvents(f"run {run!r} has no events on {', '.join(REPORT_TOPICS)}")
    return build_report(events, out_dir, run, config=cfg.model_dump(mode="json") if show_config else None)
