"""Settings of the recording proxy (`rollstream proxy`, env_workers/proxy.py): an OpenAI-compatible
chat-completions endpoint that records an outside agent's calls as the agent loop's events."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.prometheus import MetricsHost


class ProxySettings(BaseModel):
    """One proxy process: where it listens, how many episodes it holds, and the re-encoding rule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: MetricsHost = "127.0.0.1"
    """Not in the paper: address the proxy binds; loopback by default so a process opens nothing it was not asked for."""
    port: int = Field(8300, ge=0, le=65535)
    """Not in the paper: port of the proxy's HTTP server (0: any free port, printed on start)."""
    reencode_mismatch: Literal["prefix", "drop"] = "prefix"
    """Not in the paper (AgentRL's loop owns its history): what happens when an agent's next request does not
    continue the recorded conversation (it edited, reordered or truncated its context), so its history no
    longer re-encodes to the recorded tokens. "prefix": the recorded prefix up to the mismatch is the
    trajectory, trained with the episode's reward; later calls are served but not recorded. "drop": the
    episode is published as task_error (masked out of its group, never trained, the group still completes).
    Either way the trajectory's `metrics["reencode_mismatches"]` counts it."""
    idle_timeout_s: float = Field(600.0, gt=0.0)
    """Not in the paper: an open episode with no call and no end for this long (its agent crashed or forgot it)
    is ended by the proxy: published as task_error with termination `idle_timeout`, masked out of its group,
    which then completes instead of waiting for streams.group_timeout_s; its later calls are answered 404. An
    episode whose call is in flight is never idle."""
    max_episodes: int = Field(4096, ge=1)
    """Not in the paper: episodes open at once; opening another is refused (HTTP 400) until one ends."""
    worker_id: str = "proxy"
    """Not in the paper: stamped on the trajectories as `worker_id` (`rollstream proxy` adds host and pid)."""
    heartbeat_timeout_s: float = Field(10.0, gt=0.0)
    """Not in the paper: an engine whose last heartbeat is older than this is not used (as the env worker's)."""
    engine_failure_backoff_s: float = Field(5.0, ge=0.0)
    """Not in the paper: an engine that just failed a request is avoided this long (as the env worker's)."""
    served_model_name: str = "rollstream"
    """Not in the paper: the `model` the proxy's responses name (the request's own `model` is ignored)."""
