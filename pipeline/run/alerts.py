"""The work behind `rollstream alerts`: a run's alerts read back from their topic, and a resume sent.

The rules and what the alerts mean are streams/alerts.py's; the run's dispatcher and `rollstream up`
act on the events (ARCHITECTURE.md "Alerts")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas import topics
from schemas.bus import EventProducer, now_ms
from schemas.settings import KafkaSettings
from streams.alerts import RunHold, resume_event

RESUME_SOURCE = "rollstream alerts resume"


def send_resume(kafka: KafkaSettings, run: str, clock: Callable[[], int] = now_ms) -> dict[str, Any]:
    """Sends the event that lifts the run's pauses, acknowledged by the broker before it returns; returns it."""
    event = resume_event(run, RESUME_SOURCE, clock())
    producer = EventProducer(kafka, client_id=f"alerts-{run}")
    producer.send(topics.ALERTS, event, key=run)
    producer.flush()
    return event


def read_alerts(kafka: KafkaSettings, run: str, since: str | None = None) -> tuple[list[dict[str, Any]], RunHold]:
    """The run's alert events in log order, each once, and what they say now (paused, stopped)."""
    from pipeline.analysis.replay import Bound, read_topic  # lazily: the replay machinery loads pyarrow

    hold = RunHold()
    events = [r.value for r in read_topic(kafka, topics.ALERTS, run=run, start=Bound.parse(since) if since else None)
              if hold.apply(r.value)]
    return events, hold
