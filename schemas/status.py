"""Session and trajectory status: the symbols of schemas/avro/status.avsc as a Python enum.

Declared here, beside the contract, so that every component compares statuses by name
(env_workers sets them, streams masks `task_error` members) without importing another component.
A StrEnum: members equal the strings the events carry.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """Session status: the symbols of schemas/avro/status.avsc (AgentBench's, spaces as underscores)."""

    RUNNING = "running"
    COMPLETED = "completed"
    AGENT_CONTEXT_LIMIT = "agent_context_limit"
    AGENT_VALIDATION_FAILED = "agent_validation_failed"
    AGENT_INVALID_ACTION = "agent_invalid_action"
    TASK_LIMIT_REACHED = "task_limit_reached"
    TASK_ERROR = "task_error"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
