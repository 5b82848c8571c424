"""Topic names and the event type each carries: the one place these names are spelled.

The declarative topic settings (partitions, retention, compaction) live in infra/topics.yaml;
a unit test checks the two agree.
"""

from __future__ import annotations

TASKS_REQUESTED = "tasks.requested"
TASKS = "tasks"
STEPS = "steps"
TRAJECTORIES = "trajectories"
GROUPS = "groups"
BATCHES = "batches"
WEIGHTS = "weights"
ENGINES = "engines"
METRICS = "metrics"
ALERTS = "alerts"
DLQ = "dlq"

# topic -> event type (the .avsc file name in schemas/avro without the suffix)
EVENT_OF_TOPIC: dict[str, str] = {
    TASKS_REQUESTED: "task_requested",
    TASKS: "task",
    STEPS: "step",
    TRAJECTORIES: "trajectory",
    GROUPS: "group",
    BATCHES: "batch",
    WEIGHTS: "weight_version",
    ENGINES: "engine_heartbeat",
    METRICS: "metric",
    ALERTS: "alert",
    DLQ: "dead_letter",
}

ALL_TOPICS: tuple[str, ...] = tuple(EVENT_OF_TOPIC)

# Metric events (on METRICS) that another component acts on, so their names are spelled here too.
GROUP_DROPPED_METRIC = "streams/group_dropped"
"""The aggregator dropped a group (labels group_id, reason, task): the dispatcher releases its credit, and the
report counts the groups dropped as all-equal."""
BATCH_SKIPPED_METRIC = "learner/batch_skipped"
"""The learner skipped a batch it could not train on (label batch_id): the dispatcher releases its credit."""

# Object-store buckets the pipeline uses.
WEIGHTS_BUCKET = "rollstream-weights"
CHECKPOINTS_BUCKET = "rollstream-checkpoints"
PAYLOADS_BUCKET = "rollstream-payloads"
ALL_BUCKETS: tuple[str, ...] = (WEIGHTS_BUCKET, CHECKPOINTS_BUCKET, PAYLOADS_BUCKET)
