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
    DLQ: "dead_letter",
}

ALL_TOPICS: tuple[str, ...] = tuple(EVENT_OF_TOPIC)

# Object-store buckets the pipeline uses.
WEIGHTS_BUCKET = "rollstream-weights"
CHECKPOINTS_BUCKET = "rollstream-checkpoints"
PAYLOADS_BUCKET = "rollstream-payloads"
ALL_BUCKETS: tuple[str, ...] = (WEIGHTS_BUCKET, CHECKPOINTS_BUCKET, PAYLOADS_BUCKET)
