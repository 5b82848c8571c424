"""The TensorBoard scalars `rollstream tensorboard` writes for a run's `metrics` events: pure, no
Kafka and no files.

One metric event (schemas/avro/metric.avsc) becomes one scalar:
- tag: its name, then each label as key_value in key order, any character a TensorBoard tag cannot
  hold made `_` (as TensorBoard's writers do): `actor/pg_loss`,
  `streams/success_rate/task_db/worker_rollstream-streams.r1`;
- step: the step it carries. The streams worker's metrics carry none (it publishes every
  metrics_interval_s, not per step): they take the newest learner step measured before them, so
  success per task lines up with the loss of the same step;
- value: its value, except for an event that stands for one item (a dropped group, a skipped batch,
  a batch that could not be stored: it names the item with a group_id or batch_id label), which is
  counted: the value is how many such events of its name, task and reason were seen so far;
- wall time: when it was measured.

The steps of streams metrics follow the learner's only when events come in the order they were
measured; a topic of several partitions is not read in that order, so a run's history is sorted
first (`in_time_order`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ITEM_LABELS = ("group_id", "batch_id")
"""Labels that name one item: an event carrying one is counted, not plotted."""
COUNTED_BY = ("reason", "task")
"""The labels an item's count is kept apart by (the others name the item)."""
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")  # tensorboardX's (and TensorFlow's) rule for a tag's characters


@dataclass(frozen=True)
class Scalar:
    tag: str
    value: float
    step: int
    wall_time_s: float


@dataclass
class RunState:
    """What the scalars of later events depend on: the newest learner step, the items counted."""

    learner_step: int = 0
    counts: dict[str, int] = field(default_factory=dict)


def tag_of(name: str, labels: Mapping[str, str]) -> str:
    return _NOT_IN_TAGS.sub("_", "/".join([name, *(f"{key}_{labels[key]}" for key in sorted(labels))]))


def scalars(event: Mapping[str, Any], state: RunState) -> list[Scalar]:
    """The scalars of one metric event (none for a value that is not finite); updates `state`."""
    if event["source"].startswith("learner") and event["step"] is not None:
        state.learner_step = max(state.learner_step, event["step"])
    labels = event["labels"]
    if any(label in labels for label in ITEM_LABELS):
        tag = tag_of(event["name"], {k: v for k, v in labels.items() if k in COUNTED_BY})
        state.counts[tag] = state.counts.get(tag, 0) + 1
        value = float(state.counts[tag])
    else:
        tag, value = tag_of(event["name"], labels), float(event["value"])
    if not math.isfinite(value):
        return []
    step = event["step"] if event["step"] is not None else state.learner_step
    return [Scalar(tag, value, step, event["at_ms"] / 1000)]


def in_time_order(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Events in the order they were measured (ties as they came)."""
    return sorted(events, key=lambda event: event["at_ms"])
