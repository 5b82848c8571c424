"""One valid, realistic example of every event type.

Used by `rollstream smoke` and the tests; also a readable illustration of what each event holds.
Values are deterministic so round trips can be compared for equality.
"""

from __future__ import annotations

from typing import Any

from schemas import arrays

T0 = 1_764_000_000_000  # a fixed timestamp (ms) so examples compare equal


def task_requested(member: int = 0) -> dict[str, Any]:
    return {"run": "example", "group_id": "g-0001", "member": member, "group_size": 8, "task": "db",
            "split": "dev", "sample_index": 3, "epoch": 0, "validation": False, "policy_version": 5,
            "dispatched_at_ms": T0}


def task() -> dict[str, Any]:
    return {"request": task_requested(), "turn_pools": ["current", "stale", "current"],
            "routing_seed": 1234567, "stale_ratio": 0.25, "routing_reason": "mixed",
            "stale_version": 0, "routed_at_ms": T0 + 3, "max_turns": 3}


def step() -> dict[str, Any]:
    return {"run": "example", "trajectory_id": "t-0001", "group_id": "g-0001", "member": 0, "task": "db",
            "turn": 1, "planned_pool": "stale", "pool": "current", "engine_id": "engine-current-0",
            "weight_version": 5, "prompt_tokens": 412, "output_ids": arrays.pack_ids([60, 61, 62]),
            "output_logprobs": arrays.pack_logprobs([-0.5, -1.25, -0.125]), "finish_reason": "stop",
            "tool_calls": [{"name": "execute_sql", "arguments_json": '{"query": "SELECT 1"}'}],
            "parse_error": None, "env_status": "running", "reward": 0.0, "finish": False, "env_tokens": 37,
            "started_at_ms": T0 + 10, "generate_ms": 83.5, "env_ms": 4.25}


def trajectory(member: int = 0, num_tokens: int = 16, reward: float = 1.0) -> dict[str, Any]:
    prompt = num_tokens // 2
    mask = [0] * prompt + [1] * (num_tokens - prompt)
    return {"trajectory_id": f"t-{member:04d}", "run": "example", "group_id": "g-0001", "member": member,
            "group_size": 8, "task": "db", "split": "dev", "sample_index": 3, "validation": False,
            "input_ids": arrays.pack_ids([(i * 7 + member) % 256 for i in range(num_tokens)]),
            "loss_mask": arrays.pack_mask(mask),
            "rollout_logprobs": arrays.pack_logprobs([-0.25 * m for m in mask]),
            "arrays_uri": None, "num_tokens": num_tokens, "prompt_tokens": prompt,
            "turns": [{"turn": 0, "pool": "current", "engine_id": "engine-current-0", "weight_version": 5,
                       "start": prompt, "length": num_tokens - prompt, "generate_ms": 80.0, "env_ms": 3.5}],
            "status": "completed", "reward": reward, "env_reward": reward, "termination": "env_finished",
            "template_fingerprint": "0" * 64, "worker_id": "env-worker-0", "started_at_ms": T0,
            "finished_at_ms": T0 + 900, "score": 1.0, "metrics": {"invalid_calls": 0.0}}


def group() -> dict[str, Any]:
    return {"group_id": "g-0001", "run": "example", "task": "db", "split": "dev", "sample_index": 3,
            "group_size": 2, "validation": False, "completion": "complete",
            "members": [{"trajectory": trajectory(0, reward=1.0), "advantage": 0.7071, "masked": False},
                        {"trajectory": trajectory(1, reward=0.0), "advantage": -0.7071, "masked": False}],
            "reward_mean": 0.5, "reward_std": 0.7071, "all_equal": False, "min_weight_version": 5,
            "first_arrival_ms": T0 + 900, "last_arrival_ms": T0 + 950, "ready_at_ms": T0 + 951}


def batch() -> dict[str, Any]:
    return {"batch_id": "b-0001", "run": "example", "index": 0, "credit_version": 5, "group_ids": ["g-0001"],
            "items": [{"trajectory": trajectory(0, reward=1.0), "group_advantage": 0.7071, "advantage": 1.0},
                      {"trajectory": trajectory(1, reward=0.0), "group_advantage": -0.7071, "advantage": -1.0}],
            "task_stats": [{"task": "db", "trajectories": 2, "tokens": 16, "mean_before": 0.0, "std_before": 0.7071,
                            "mean_after": 0.0, "std_after": 1.0}],
            "created_at_ms": T0 + 1000, "payload_uri": None, "payload_sha256": None, "payload_bytes": None}


def weight_version() -> dict[str, Any]:
    return {"run": "example", "version": 6, "step": 6, "batch_id": "b-0001",
            "manifest_uri": "s3://rollstream-weights/example/v000006/manifest.json",
            "shards": [{"uri": "s3://rollstream-weights/example/v000006/shard-00000.safetensors",
                        "sha256": "ab" * 32, "size_bytes": 1 << 20}],
            "broadcast_pools": ["current"], "published_at_ms": T0 + 2000}


def engine_heartbeat() -> dict[str, Any]:
    return {"engine_id": "engine-current-0", "pool": "current", "url": "http://127.0.0.1:8100",
            "model": "/models/default", "loaded_version": 6, "queue_depth": 2, "running": 30, "healthy": True,
            "detail": "", "sent_at_ms": T0 + 2100, "run": "example", "busy": "", "busy_for_ms": 0}


def metric() -> dict[str, Any]:
    return {"run": "example", "name": "actor/pg_loss", "value": -0.0123, "step": 6, "labels": {"task": "db"},
            "source": "learner", "at_ms": T0 + 2200}


def alert() -> dict[str, Any]:
    return {"alert_id": "example/looping/os/1", "run": "example", "rule": "looping", "task": "os",
            "figure": "repeated_call_share", "value": 0.62, "threshold": 0.5, "direction": "above", "action": "pause",
            "steps": 240, "trajectories": 31, "source": "rollstream-streams.example", "at_ms": T0 + 2250}


def dead_letter() -> dict[str, Any]:
    return {"source_topic": "trajectories", "source_partition": 3, "source_offset": 42, "key": b"g-0001",
            "value": b"\x00not avro", "reason": "not an Avro single-object encoding", "error_type": "UndecodableEvent",
            "consumer": "streams", "failed_at_ms": T0 + 2300}


EXAMPLES = {
    "task_requested": task_requested, "task": task, "step": step, "trajectory": trajectory, "group": group,
    "batch": batch, "weight_version": weight_version, "engine_heartbeat": engine_heartbeat, "metric": metric,
    "alert": alert, "dead_letter": dead_letter,
}


def example(event_type: str) -> dict[str, Any]:
    """A valid example of `event_type`."""
    return EXAMPLES[event_type]()
