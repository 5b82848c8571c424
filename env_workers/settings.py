"""Settings of the rollout side's agent loop (ARCHITECTURE.md "The method": token-in, token-out loop)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from env_workers.latency import StepLatency


class AgentLoopSettings(BaseModel):
    """Limits, sampling and failure handling of one multi-turn rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(20, ge=1)
    """AgentRL max_turns 20: assistant turns before the session ends as task_limit_reached."""
    max_total_len: int = Field(8192, ge=16)
    """AgentRL max_total_len 8192: tokens of the whole trajectory (prompt, turns, environment messages)."""
    max_new_tokens: int = Field(1024, ge=1)
    """AgentRL per-turn generation cap 1024 (min'ed with what max_total_len leaves)."""
    temperature: float = Field(0.8, gt=0.0)
    """AgentRL rollout temperature 0.8."""
    incomplete_punishment: float = -0.2
    """AgentRL incomplete_punishment -0.2: the reward of a trajectory whose status is not completed (task_error excepted)."""
    engine_retries: int = Field(3, ge=0)
    """Not in the paper: retries of one turn's engine call (same prompt tokens) before the trajectory is a task_error."""
    engine_retry_backoff_s: float = Field(0.5, ge=0.0)
    """Not in the paper: first retry delay, doubled at each further retry."""
    engine_timeout_s: float = Field(600.0, gt=0.0)
    """Not in the paper: one completion request's timeout (1024 tokens on a busy CPU engine take minutes)."""
    step_latency: StepLatency = StepLatency()
    """Not in the paper: delay added to every environment step, for benchmarks (off by default)."""
