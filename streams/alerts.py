"""Behaviour alert rules at work: which rules a task's figures set off, and what a run's alerts mean
for the run. Pure: rules (streams/settings.py AlertRule), figures (streams/behaviour.py) and plain
dicts in, decisions and `alert` events (schemas/avro/alert.avsc) out; the caller passes the time.

Once per crossing. A rule fires for a task when the figure is past its threshold and enough of the
task has been counted (min_steps, min_trajectories); then not again until the figure has come back
to the other side, which re-arms it. A policy that stays broken raises one alert, not one per step.
Each change of a rule's state on a task (fired, re-armed) gets the next number, and an alert's id
carries it: an alert raised again for the same change (a worker replaying events after a crash) has
the same id, and readers count it once.

Where the state lives. The metrics job counts a task in one table row per source partition
(streams/metrics_agent.py), and a Faust table write belongs to the partition being processed. So a
change is recorded beside the row of the partition whose event caused it, as [fired, number], and a
rule's state on the task is the change of highest number among the task's rows (`latest`).

What alerts mean for a run (`RunHold`), read in log order (the `alerts` topic has one partition):
a pause holds the run's dispatcher until a resume; a stop ends the run (`rollstream up`); a resume
lifts every pause before it, not a stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streams.settings import AlertRule

ALERT, PAUSE, STOP, RESUME = "alert", "pause", "stop", "resume"
ALL_TASKS = "*"

RuleStates = dict[str, tuple[bool, int]]
"""rule name -> (fired, number of the change that set it) on one task."""


@dataclass(frozen=True)
class Change:
    """A rule's state changing on a task: it fires (an alert to publish) or re-arms."""

    rule: AlertRule
    fired: bool
    value: float
    """The figure's value that caused it."""
    number: int
    """The change's number for this rule and task, from 1: the first firing is 1, its re-arming 2, ..."""


def latest(records: Iterable[Mapping[str, Sequence[Any]] | None]) -> RuleStates:
    """Each rule's state on a task from its partitions' records ({rule: [fired, number]}): the latest change."""
    out: RuleStates = {}
    for record in records:
        for name, (fired, number) in (record or {}).items():
            if name not in out or number > out[name][1]:
                out[name] = (bool(fired), int(number))
    return out


def crossed(rule: AlertRule, value: float) -> bool:
    """Whether the value is on the firing side of the rule's threshold (the threshold itself is not)."""
    return value > rule.threshold if rule.direction == "above" else value < rule.threshold


def check(rules: Iterable[AlertRule], task: str, figures: Mapping[str, Any], steps: int, trajectories: int,
          states: RuleStates) -> list[Change]:
    """The changes of the rules watching `task`, given its figures (streams/behaviour.figures), how much
    of it has been counted and the rules' states on it."""
    changes = []
    for rule in rules:
        value = figures.get(rule.figure)
        if rule.task not in (ALL_TASKS, task) or value is None:  # None: a share of nothing yet
            continue
        fired, number = states.get(rule.name, (False, 0))
        enough = steps >= rule.min_steps and trajectories >= rule.min_trajectories
        if not fired and enough and crossed(rule, value):
            changes.append(Change(rule, True, float(value), number + 1))
        elif fired and not crossed(rule, value):
            changes.append(Change(rule, False, float(value), number + 1))
    return changes


def alert_event(run: str, task: str, change: Change, steps: int, trajectories: int, source: str,
                at_ms: int) -> dict[str, Any]:
    """The `alert` event of a rule that fired."""
    rule = change.rule
    return {"alert_id": f"{run}/{rule.name}/{task}/{change.number}", "run": run, "rule": rule.name, "task": task,
            "figure": rule.figure, "value": change.value, "threshold": rule.threshold, "direction": rule.direction,
            "action": rule.action, "steps": int(steps), "trajectories": int(trajectories), "source": source,
            "at_ms": at_ms}


def resume_event(run: str, source: str, at_ms: int) -> dict[str, Any]:
    """The `alert` event that lifts a run's pauses."""
    return {"alert_id": f"{run}/{RESUME}/{at_ms}", "run": run, "rule": "", "task": ALL_TASKS, "figure": "",
            "value": None, "threshold": None, "direction": None, "action": RESUME, "steps": 0, "trajectories": 0,
            "source": source, "at_ms": at_ms}


def describe(alert: Mapping[str, Any]) -> str:
    """One line: 'pause: rule loops on os, repeated_call_share 0.62 above 0.5 after 240 steps, 31 trajectories'."""
    if alert["action"] == RESUME:
        return f"resume ({alert['source']})"
    return (f"{alert['action']}: rule {alert['rule']} on {alert['task']}, {alert['figure']} {alert['value']:.4g} "
            f"{alert['direction']} {alert['threshold']:g} after {alert['steps']} steps, "
            f"{alert['trajectories']} trajectories")


@dataclass
class RunHold:
    """What a run's alerts say about it, folded in log order: the rule that paused its dispatcher (until a
    resume) and the rule that stopped it (for good). Alerts count once by id (delivery is at-least-once), so
    a pause delivered again after a resume does not pause the run again."""

    paused_by: str | None = None
    stopped_by: str | None = None
    seen: set[str] = field(default_factory=set)

    @property
    def held_by(self) -> str | None:
        """The rule that keeps the dispatcher from sending new tasks, if any."""
        return self.stopped_by or self.paused_by

    def apply(self, alert: Mapping[str, Any]) -> bool:
        """Folds one of the run's alert events; False when it was already seen."""
        if alert["alert_id"] in self.seen:
            return False
        self.seen.add(alert["alert_id"])
        action = alert["action"]
        if action == PAUSE and self.paused_by is None:
            self.paused_by = alert["rule"]
        elif action == STOP and self.stopped_by is None:
            self.stopped_by = alert["rule"]
        elif action == RESUME:
            self.paused_by = None
        return True
