"""The live picture of one run, folded from its events: what `rollstream up` shows while it trains.

Pure: `RunView.apply(topic, event, now_ms)` takes decoded events in any order (duplicates
included: delivery is at-least-once) and `snapshot()` returns plain figures; `render()` turns a
snapshot into rich tables. Nothing here reads Kafka.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from rich.console import Group
from rich.table import Table

from pipeline.analysis.evaluation import is_success
from schemas import topics
from streams import behaviour
from streams.alerts import RunHold

RATE_WINDOW_MS = 60_000  # trajectories/s and tokens/s are averaged over the last minute
RECENT = 64  # per-task success and reward over each task's last RECENT training trajectories


@dataclass
class TaskFigures:
    done: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (success, reward)


@dataclass
class RunView:
    """Everything the progress screen shows, for one run."""

    run: str
    learner_step: int = 0
    learner_version: int = 0
    learner_metrics: dict[str, float] = field(default_factory=dict)
    requested: set[str] = field(default_factory=set)  # "group_id/member" of every task requested
    finished: set[str] = field(default_factory=set)
    trajectory_ids: set[str] = field(default_factory=set)
    tasks: dict[str, TaskFigures] = field(default_factory=lambda: defaultdict(TaskFigures))
    finished_at: deque = field(default_factory=deque)  # (finished_at_ms, num_tokens) of recent trajectories
    steps: int = 0
    stale_steps: int = 0
    staleness: Counter = field(default_factory=Counter)  # learner version - version that generated a turn
    validation_round_of_group: dict[str, int] = field(default_factory=dict)
    validation_requested: Counter = field(default_factory=Counter)  # round -> members requested
    validation_done: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    behaviour: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per task, streams/behaviour.py's counters over every step and trajectory seen (validation too, as the
    metrics agent counts them: how the policy acts does not depend on what the rollout is for)."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """The run's `alerts` events in log order, each once."""
    hold: RunHold = field(default_factory=RunHold)
    """What they say: paused (by which rule), stopped."""

    def apply(self, topic: str, event: Mapping[str, Any], now_ms: int) -> None:
        if topic == topics.ENGINES:
            if event["engine_id"].startswith(f"{self.run}."):  # heartbeats carry no run; ids of a run's engines do
                self.engines[event["engine_id"]] = dict(event)
            return
        if event.get("run") != self.run:
            return
        if topic == topics.TASKS_REQUESTED:
            key = f"{event['group_id']}/{event['member']}"
            if event["validation"] and key not in self.requested:
                self.validation_round_of_group[event["group_id"]] = event["epoch"]
                self.validation_requested[event["epoch"]] += 1
            self.requested.add(key)
        elif topic == topics.TRAJECTORIES:
            self._trajectory(event, now_ms)
        elif topic == topics.STEPS:
            self.behaviour[event["task"]] = behaviour.count_step(self.behaviour.get(event["task"], {}), event)
            self.steps += 1
            self.stale_steps += event["pool"] == "stale"
            self.staleness[max(0, self.learner_version - event["weight_version"])] += 1
        elif topic == topics.WEIGHTS:
            self.learner_version = max(self.learner_version, event["version"])
            self.learner_step = max(self.learner_step, event["step"])
        elif topic == topics.METRICS and event["source"].startswith("learner") and event["value"] is not None:
            self.learner_metrics[event["name"]] = event["value"]
        elif topic == topics.ALERTS and self.hold.apply(event):  # one partition: in log order
            self.alerts.append(dict(event))

    def _trajectory(self, t: Mapping[str, Any], now_ms: int) -> None:
        if t["trajectory_id"] in self.trajectory_ids:
            return  # an at-least-once duplicate
        self.trajectory_ids.add(t["trajectory_id"])
        self.finished.add(f"{t['group_id']}/{t['member']}")
        self.behaviour[t["task"]] = behaviour.count_trajectory(self.behaviour.get(t["task"], {}), t)
        if t["validation"]:
            round_ = self.validation_round_of_group.get(t["group_id"])
            if round_ is not None:
                self.validation_done[round_].append(dict(t))
            return
        figures = self.tasks[t["task"]]
        figures.done += 1
        figures.recent.append((is_success(t), t["reward"]))
        self.statuses[t["status"]] += 1
        self.finished_at.append((t["finished_at_ms"], t["num_tokens"]))
        while self.finished_at and self.finished_at[0][0] < now_ms - RATE_WINDOW_MS:
            self.finished_at.popleft()

    def validation_complete(self, round_: int) -> bool:
        """Every member requested for this validation round has its trajectory."""
        requested = self.validation_requested.get(round_, 0)
        return requested > 0 and len(self.validation_done.get(round_, [])) >= requested

    def snapshot(self, now_ms: int) -> dict[str, Any]:
        window = [(t, n) for t, n in self.finished_at if t >= now_ms - RATE_WINDOW_MS]
        span_s = RATE_WINDOW_MS / 1000
        staleness_total = sum(self.staleness.values())
        return {
            "learner_step": self.learner_step, "learner_version": self.learner_version,
            "loss": self.learner_metrics.get("actor/loss"), "kl": self.learner_metrics.get("actor/kl_loss"),
            "clipfrac": self.learner_metrics.get("actor/pg_clipfrac"),
            "tasks": {task: {"trajectories": f.done,
                             "success_rate": sum(s for s, _ in f.recent) / len(f.recent) if f.recent else None,
                             "mean_reward": sum(r for _, r in f.recent) / len(f.recent) if f.recent else None}
                      for task, f in sorted(self.tasks.items())},
            "trajectories_per_s": len(window) / span_s, "tokens_per_s": sum(n for _, n in window) / span_s,
            "queue_depth": len(self.requested - self.finished),
            "mean_staleness": (sum(k * v for k, v in self.staleness.items()) / staleness_total
                               if staleness_total else None),
            "stale_turn_share": self.stale_steps / self.steps if self.steps else None,
            "validation": {r: {"requested": n, "done": len(self.validation_done.get(r, []))}
                           for r, n in sorted(self.validation_requested.items())},
            "behaviour": {task: behaviour.figures(c) for task, c in sorted(self.behaviour.items())},
            "alerts": [dict(a) for a in self.alerts], "paused_by": self.hold.paused_by,
            "stopped_by": self.hold.stopped_by,
            "engines": {e: {"pool": h["pool"], "version": h["loaded_version"], "queue": h["queue_depth"],
                            "healthy": h["healthy"], "busy": h.get("busy", "")} for e, h in sorted(self.engines.items())},
        }


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "—" if value is None else pattern.format(value)


def _alerts_table(snap: Mapping[str, Any]) -> Table:
    run = snap["alerts"][0]["run"]
    state = (f"stopped by {snap['stopped_by']}" if snap["stopped_by"] else
             f"paused by {snap['paused_by']}: rollstream alerts resume --run {run}" if snap["paused_by"] else "")
    table = Table(title="alerts (streams.alerts rules)", caption=state or None)
    for col in ("time (UTC)", "action", "rule", "task", "figure", "value", "threshold"):
        table.add_column(col, justify="right")
    for a in snap["alerts"]:
        crossed = "" if a["direction"] is None else f"{a['direction']} {a['threshold']:g}"
        table.add_row(time.strftime("%H:%M:%S", time.gmtime(a["at_ms"] / 1000)), a["action"], a["rule"] or "—",
                      a["task"], a["figure"] or "—", _fmt(a["value"], "{:.3g}"), crossed or "—")
    return table


def render(snap: Mapping[str, Any], title: str) -> Group:
    """The progress screen: run figures, per-task figures, engines."""
    head = Table(title=title, show_header=True, expand=False)
    for col in ("learner step", "version", "traj/s", "tokens/s", "queue", "staleness", "stale turns",
                "loss", "KL", "clip frac"):
        head.add_column(col, justify="right")
    head.add_row(str(snap["learner_step"]), str(snap["learner_version"]), _fmt(snap["trajectories_per_s"]),
                 _fmt(snap["tokens_per_s"], "{:.0f}"), str(snap["queue_depth"]), _fmt(snap["mean_staleness"]),
                 _fmt(snap["stale_turn_share"], "{:.0%}"), _fmt(snap["loss"], "{:.4f}"), _fmt(snap["kl"], "{:.2e}"),
                 _fmt(snap["clipfrac"], "{:.3f}"))
    per_task = Table(title=f"training trajectories (success and reward over each task's last {RECENT})")
    for col in ("task", "trajectories", "success", "mean reward"):
        per_task.add_column(col, justify="right")
    for task, f in snap["tasks"].items():
        per_task.add_row(task, str(f["trajectories"]), _fmt(f["success_rate"], "{:.0%}"), _fmt(f["mean_reward"]))
    parts: list[Any] = [head, per_task]
    if snap["behaviour"]:
        acted = Table(title="behaviour, all rollouts (streams/behaviour.py)")
        for col in ("task", "steps", "invalid output", "truncated", "NLL/token", "tool errors", "repeated calls",
                    "dangerous calls"):
            acted.add_column(col, justify="right")
        for task, b in snap["behaviour"].items():
            acted.add_row(task, str(b["steps"]), _fmt(b["invalid_output_share"], "{:.0%}"),
                          _fmt(b["truncation_share"], "{:.0%}"), _fmt(b["mean_token_nll"], "{:.3f}"),
                          _fmt(b["tool_error_share"], "{:.0%}"), _fmt(b["repeated_call_share"], "{:.0%}"),
                          str(b["dangerous_calls"]))
        parts.append(acted)
    if snap["alerts"]:
        parts.append(_alerts_table(snap))
    if snap["validation"]:
        val = Table(title="validation rounds")
        for col in ("round", "done / requested"):
            val.add_column(col, justify="right")
        for r, v in snap["validation"].items():
            val.add_row(str(r), f"{v['done']} / {v['requested']}")
        parts.append(val)
    if snap["engines"]:
        eng = Table(title="engines")
        for col in ("engine", "pool", "version", "queue", "healthy", "busy"):
            eng.add_column(col)
        for e, h in snap["engines"].items():
            eng.add_row(e, h["pool"], str(h["version"]), str(h["queue"]), "yes" if h["healthy"] else "NO",
                        h["busy"] or "—")
        parts.append(eng)
    return Group(*parts)
