"""The flat documented columns of every topic's replay and its Arrow schema.

Column names and meanings are listed in pipeline/analysis/REPLAY.md; a unit test keeps the two in
step. A column copied from an event field takes its name, Arrow type and description from the
field's Avro schema, so a misspelt field fails at import. Token arrays (packed bytes in the events,
schemas/arrays.py) become list columns. Nested records become parallel list columns with one entry
per member, item, turn or shard (`member_rewards[i]` belongs to `member_trajectory_ids[i]`) plus
scalar summaries: an analyst gets one row per event and joins on trajectory_id for the full
trajectory (the `trajectories` replay). Maps become JSON text with sorted keys. Timestamps stay
int64 milliseconds since the Unix epoch (UTC), as in the events.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.analysis.replay_records import ReplayRecord
from schemas import topics
from schemas.arrays import unpack_ids, unpack_logprobs, unpack_mask
from schemas.codec import codec


@dataclass(frozen=True)
class Column:
    """One flat column: its name, Arrow type, meaning, and how to read it from an event."""

    name: str
    type: pa.DataType
    description: str
    get: Callable[[Any], Any]
    nullable: bool = False


_PRIMITIVE = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
              "float": pa.float32(), "boolean": pa.bool_(), "bytes": pa.binary()}


def _enum_names() -> set[str]:
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "enum":
                names.add(f"{node.get('namespace', 'rollstream.events')}.{node['name']}")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for event_type in topics.EVENT_OF_TOPIC.values():
        walk(codec().schema(event_type))
    return names


_ENUMS = _enum_names()


def _arrow_type(avro: Any) -> tuple[pa.DataType, bool]:
    """(Arrow type, nullable) of an Avro field type: enums are strings, ["null", T] is nullable T."""
    if isinstance(avro, list):
        others = [t for t in avro if t != "null"]
        if len(others) != 1:
            raise TypeError(f"no flat column for the union {avro}")
        return _arrow_type(others[0])[0], "null" in avro
    if isinstance(avro, str):
        if avro in _PRIMITIVE:
            return _PRIMITIVE[avro], False
        if avro in _ENUMS:
            return pa.string(), False
    if isinstance(avro, dict):
        if avro["type"] == "enum":
            return pa.string(), False
        if avro["type"] == "array":
            return pa.list_(_arrow_type(avro["items"])[0]), False
    raise TypeError(f"no flat column for the Avro type {avro}")


def _avro_field(event_type: str, path: Sequence[str]) -> dict[str, Any]:
    node = codec().schema(event_type)
    for i, name in enumerate(path):
        fields = {f["name"]: f for f in node["fields"]}
        if name not in fields:
            raise KeyError(f"{event_type} has no field {'.'.join(path[:i + 1])}")
        if i == len(path) - 1:
            return fields[name]
        node = fields[name]["type"]
    raise KeyError(f"empty field path in {event_type}")


def _copied(event_type: str, *path: str, prefix: str = "") -> Column:
    """A column copied from the event field at `path`, typed and described by its Avro schema."""
    spec = _avro_field(event_type, path)
    arrow, nullable = _arrow_type(spec["type"])

    def get(v: Mapping[str, Any]) -> Any:
        for name in path:
            v = v[name]
        return v

    return Column(path[-1], arrow, prefix + spec["doc"], get, nullable)


def _copied_all(event_type: str, *names: str) -> list[Column]:
    return [_copied(event_type, n) for n in names]


def _every_field(event_type: str) -> list[Column]:
    return _copied_all(event_type, *(f["name"] for f in codec().schema(event_type)["fields"]))


def _json_text(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True)


def _key_text(key: bytes | None) -> str | None:
    return None if key is None else key.decode("utf-8", "backslashreplace")


def action_tokens(trajectory: Mapping[str, Any]) -> int:
    """Tokens with loss_mask 1; when the arrays were offloaded, the turns' lengths (which count them)."""
    if trajectory["arrays_uri"] is None:
        return int(np.count_nonzero(unpack_mask(trajectory["loss_mask"])))
    return sum(t["length"] for t in trajectory["turns"])


def _weight_versions(trajectories: Iterable[Mapping[str, Any]]) -> list[int]:
    return [t["weight_version"] for tr in trajectories for t in tr["turns"]]


I32, I64, F32, F64, STR, BOOL = pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.string(), pa.bool_()


def _list(t: pa.DataType) -> pa.DataType:
    return pa.list_(t)


COMMON_COLUMNS: tuple[Column, ...] = (
    Column("_partition", I32, "Kafka partition the event was read from.", lambda r: r.partition),
    Column("_offset", I64, "Offset of the event within its partition.", lambda r: r.offset),
    Column("_timestamp_ms", I64, "Kafka record timestamp (the producer's create time), milliseconds since "
           "the Unix epoch (UTC).", lambda r: r.timestamp_ms),
    Column("_key", STR, "Kafka record key as UTF-8 text (invalid bytes backslash-escaped); null when the "
           "record has none.", lambda r: _key_text(r.key), nullable=True),
)


def _task_columns() -> list[Column]:
    request = [_copied("task", "request", n.name, prefix="From the dispatcher's request: ")
               for n in _TASK_REQUESTED]
    return request + [
        _copied("task", "turn_pools"),
        Column("stale_turns", I32, "Turns the plan routes to the stale pool.",
               lambda v: sum(p == "stale" for p in v["turn_pools"])),
        *_copied_all("task", "routing_seed", "stale_ratio", "routing_reason", "stale_version", "routed_at_ms"),
    ]


def _step_columns() -> list[Column]:
    return [
        *_copied_all("step", "run", "trajectory_id", "group_id", "member", "task", "turn", "planned_pool", "pool",
                     "engine_id", "weight_version", "prompt_tokens"),
        Column("output_ids", _list(I32), "Generated token ids (unpacked from the int32 bytes).",
               lambda v: unpack_ids(v["output_ids"]).tolist()),
        Column("output_logprobs", _list(F32), "Sampling log-prob of each generated token (unpacked from the "
               "float32 bytes).", lambda v: unpack_logprobs(v["output_logprobs"]).tolist()),
        Column("output_tokens", I32, "Number of generated tokens.", lambda v: len(unpack_ids(v["output_ids"]))),
        _copied("step", "finish_reason"),
        Column("tool_call_names", _list(STR), "Names of the tool calls parsed from the turn, in order.",
               lambda v: [c["name"] for c in v["tool_calls"]]),
        Column("tool_call_arguments_json", _list(STR), "Arguments (JSON object text) of each tool call, "
               "parallel to tool_call_names.", lambda v: [c["arguments_json"] for c in v["tool_calls"]]),
        *_copied_all("step", "parse_error", "env_status", "reward", "finish", "env_tokens", "started_at_ms",
                     "generate_ms", "env_ms"),
    ]


def _turns(name: str, field_name: str, arrow: pa.DataType, meaning: str) -> Column:
    return Column(name, _list(arrow), f"Per assistant turn, in turn order: {meaning}",
                  lambda v: [t[field_name] for t in v["turns"]])


def _trajectory_columns() -> list[Column]:
    return [
        *_copied_all("trajectory", "trajectory_id", "run", "group_id", "member", "group_size", "task", "split",
                     "sample_index", "validation"),
        Column("input_ids", _list(I32), "Whole token sequence (prompt, assistant turns, environment messages); "
               "empty when the arrays were offloaded (arrays_uri).", lambda v: unpack_ids(v["input_ids"]).tolist()),
        Column("loss_mask", _list(pa.uint8()), "1 on the tokens the policy generated, 0 elsewhere; one per input "
               "id (empty when offloaded).", lambda v: unpack_mask(v["loss_mask"]).tolist()),
        Column("rollout_logprobs", _list(F32), "Sampling log-prob of each token under its generating engine, 0 "
               "where loss_mask is 0; one per input id (empty when offloaded).",
               lambda v: unpack_logprobs(v["rollout_logprobs"]).tolist()),
        *_copied_all("trajectory", "arrays_uri", "num_tokens", "prompt_tokens"),
        Column("action_tokens", I64, "Tokens with loss_mask 1 (the sum of the turns' lengths when offloaded).",
               action_tokens),
        Column("num_turns", I32, "Number of assistant turns.", lambda v: len(v["turns"])),
        _turns("turn_pools", "pool", STR, "pool that generated it."),
        _turns("turn_engine_ids", "engine_id", STR, "engine that generated it."),
        _turns("turn_weight_versions", "weight_version", I64,
               "weight version that generated it (its behaviour policy)."),
        _turns("turn_starts", "start", I32, "offset of its first generated token in input_ids."),
        _turns("turn_lengths", "length", I32, "number of its generated tokens (loss_mask 1)."),
        _turns("turn_generate_ms", "generate_ms", F64, "engine time, milliseconds."),
        _turns("turn_env_ms", "env_ms", F64, "environment time, milliseconds."),
        Column("stale_turns", I32, "Turns generated by the stale pool.",
               lambda v: sum(t["pool"] == "stale" for t in v["turns"])),
        Column("min_weight_version", I64, "Oldest weight version over its turns; null without turns.",
               lambda v: min(_weight_versions([v]), default=None), nullable=True),
        Column("max_weight_version", I64, "Newest weight version over its turns; null without turns.",
               lambda v: max(_weight_versions([v]), default=None), nullable=True),
        *_copied_all("trajectory", "status", "reward", "env_reward", "termination", "template_fingerprint",
                     "worker_id", "started_at_ms", "finished_at_ms", "score"),
        Column("metrics_json", STR, "Environment and loop metrics of the session as a JSON object with sorted "
               "keys.", lambda v: _json_text(v["metrics"])),
    ]


def _members(name: str, arrow: pa.DataType, meaning: str, get: Callable[[Mapping[str, Any]], Any]) -> Column:
    return Column(f"member_{name}", _list(arrow), f"Per member, in member order: {meaning}",
                  lambda v: [get(m) for m in v["members"]])


def _group_columns() -> list[Column]:
    return [
        *_copied_all("group", "group_id", "run", "task", "split", "sample_index", "group_size", "validation",
                     "completion"),
        Column("num_members", I32, "Members present in the event (masked ones included).", lambda v: len(v["members"])),
        Column("num_masked", I32, "Members masked out of training (infrastructure failures).",
               lambda v: sum(m["masked"] for m in v["members"])),
        _members("indices", I32, "member index in the group.", lambda m: m["trajectory"]["member"]),
        _members("trajectory_ids", STR, "trajectory id (join with the trajectories replay).",
                 lambda m: m["trajectory"]["trajectory_id"]),
        _members("rewards", F64, "final reward of the trajectory.", lambda m: m["trajectory"]["reward"]),
        _members("statuses", STR, "final status of the trajectory.", lambda m: m["trajectory"]["status"]),
        _members("advantages", F64, "GRPO advantage (0 for masked members).", lambda m: m["advantage"]),
        _members("masked", BOOL, "excluded from training.", lambda m: m["masked"]),
        _members("action_tokens", I64, "tokens with loss_mask 1.", lambda m: action_tokens(m["trajectory"])),
        *_copied_all("group", "reward_mean", "reward_std", "all_equal", "min_weight_version", "first_arrival_ms",
                     "last_arrival_ms", "ready_at_ms"),
    ]


def _items(name: str, arrow: pa.DataType, meaning: str, get: Callable[[Mapping[str, Any]], Any]) -> Column:
    return Column(f"item_{name}", _list(arrow), f"Per batch item, in batch order: {meaning}",
                  lambda v: [get(i) for i in v["items"]])


def _task_stats(name: str, arrow: pa.DataType) -> Column:
    spec = _avro_field("batch", ("task_stats",))["type"]["items"]
    doc = next(f["doc"] for f in spec["fields"] if f["name"] == name)
    return Column(f"task_stats_{name}", _list(arrow), f"Per task of the batch (tasks sorted by name): {doc}",
                  lambda v: [s[name] for s in v["task_stats"]])


def _batch_columns() -> list[Column]:
    return [
        *_copied_all("batch", "batch_id", "run", "index", "credit_version", "group_ids"),
        Column("num_groups", I32, "Groups in the batch.", lambda v: len(v["group_ids"])),
        Column("num_items", I32, "Trajectories in the batch.", lambda v: len(v["items"])),
        _items("trajectory_ids", STR, "trajectory id.", lambda i: i["trajectory"]["trajectory_id"]),
        _items("group_ids", STR, "group of the trajectory.", lambda i: i["trajectory"]["group_id"]),
        _items("tasks", STR, "task family of the trajectory.", lambda i: i["trajectory"]["task"]),
        _items("rewards", F64, "final reward of the trajectory.", lambda i: i["trajectory"]["reward"]),
        _items("action_tokens", I64, "tokens with loss_mask 1.", lambda i: action_tokens(i["trajectory"])),
        _items("group_advantages", F64, "GRPO advantage before task normalization.", lambda i: i["group_advantage"]),
        _items("advantages", F64, "final advantage after per-task token-weighted standardization.",
               lambda i: i["advantage"]),
        Column("action_tokens", I64, "Tokens with loss_mask 1 over the whole batch.",
               lambda v: sum(action_tokens(i["trajectory"]) for i in v["items"])),
        Column("min_weight_version", I64, "Oldest behaviour weight version over the items' turns; null without "
               "turns.", lambda v: min(_weight_versions(i["trajectory"] for i in v["items"]), default=None),
               nullable=True),
        _task_stats("task", STR), _task_stats("trajectories", I32), _task_stats("tokens", I64),
        _task_stats("mean_before", F64), _task_stats("std_before", F64),
        _task_stats("mean_after", F64), _task_stats("std_after", F64),
        _copied("batch", "created_at_ms"),
        *_copied_all("batch", "payload_uri", "payload_sha256", "payload_bytes"),
    ]


def _weights_columns() -> list[Column]:
    return [
        *_copied_all("weight_version", "run", "version", "step", "batch_id", "manifest_uri"),
        Column("shard_uris", _list(STR), "s3://bucket/key of each safetensors shard.",
               lambda v: [s["uri"] for s in v["shards"]]),
        Column("shard_sha256", _list(STR), "Hex sha256 of each shard, parallel to shard_uris.",
               lambda v: [s["sha256"] for s in v["shards"]]),
        Column("shard_size_bytes", _list(I64), "Size of each shard in bytes, parallel to shard_uris.",
               lambda v: [s["size_bytes"] for s in v["shards"]]),
        Column("total_size_bytes", I64, "Sum of the shard sizes in bytes.",
               lambda v: sum(s["size_bytes"] for s in v["shards"])),
        *_copied_all("weight_version", "broadcast_pools", "published_at_ms"),
    ]


def _metric_columns() -> list[Column]:
    return [
        *_copied_all("metric", "run", "name", "value", "step"),
        Column("labels_json", STR, "Dimensions of the measurement, e.g. {\"task\": \"db\"}, as a JSON object with "
               "sorted keys.", lambda v: _json_text(v["labels"])),
        *_copied_all("metric", "source", "at_ms"),
    ]


def _dead_letter_columns() -> list[Column]:
    return [
        *_copied_all("dead_letter", "source_topic", "source_partition", "source_offset"),
        Column("key", STR, "Original key as UTF-8 text (invalid bytes backslash-escaped); null when none.",
               lambda v: _key_text(v["key"]), nullable=True),
        _copied("dead_letter", "value"),
        Column("value_size_bytes", I64, "Length of the original value in bytes; null when there was none.",
               lambda v: None if v["value"] is None else len(v["value"]), nullable=True),
        *_copied_all("dead_letter", "reason", "error_type", "consumer", "failed_at_ms"),
    ]


_TASK_REQUESTED = _every_field("task_requested")

COLUMNS: dict[str, tuple[Column, ...]] = {
    topics.TASKS_REQUESTED: tuple(_TASK_REQUESTED),
    topics.TASKS: tuple(_task_columns()),
    topics.STEPS: tuple(_step_columns()),
    topics.TRAJECTORIES: tuple(_trajectory_columns()),
    topics.GROUPS: tuple(_group_columns()),
    topics.BATCHES: tuple(_batch_columns()),
    topics.WEIGHTS: tuple(_weights_columns()),
    topics.ENGINES: tuple(_every_field("engine_heartbeat")),
    topics.METRICS: tuple(_metric_columns()),
    topics.ALERTS: tuple(_every_field("alert")),
    topics.DLQ: tuple(_dead_letter_columns()),
}


def columns(topic: str) -> tuple[Column, ...]:
    """Every column of a topic's replay, the common ones first."""
    return COMMON_COLUMNS + COLUMNS[topic]


def arrow_schema(topic: str) -> pa.Schema:
    """The Arrow schema of a topic's replay; each field's metadata holds its description."""
    return pa.schema(
        [pa.field(c.name, c.type, nullable=c.nullable, metadata={"description": c.description})
         for c in columns(topic)],
        metadata={"rollstream.topic": topic, "rollstream.event_type": topics.EVENT_OF_TOPIC[topic]})


def flatten(record: ReplayRecord) -> dict[str, Any]:
    """One row of the topic's flat columns, in column order."""
    row = {c.name: c.get(record) for c in COMMON_COLUMNS}
    row.update((c.name, c.get(record.value)) for c in COLUMNS[record.topic])
    return row
