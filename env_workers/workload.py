"""A benchmark's workload shape: what slow tools, long episodes and long answers cost, on environments
that answer in microseconds here and on a random policy that uses every turn and token it is given.
None of it changes a task, its grader or the reward rule; all of it is off by default.

- Step latency, added to every environment step: log-normal (AgentRL's and ROLL's measurements of
  agentic environments: most steps fast, a heavy tail of slow ones), `median_s` and `sigma` (the std
  of the log; sigma 1 puts the 99th percentile at about 10x the median), capped at `max_s`.
- Per family (`agent_loop.workload`, a list of `FamilyWorkload`): its own step latency, a turn budget per
  trajectory and a cap on each turn's new tokens, both log-normal counts (at least 1, never above the
  loop's own limits), so that turn counts and response lengths are heavy-tailed per task as they are for a
  policy that ends turns and episodes by itself.

Every draw is a pure function of (trajectory id, turn), so a re-rollout waits and generates as long as
the first rollout did, and two benchmark modes given the same tasks see the same shapes.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist

from pydantic import BaseModel, ConfigDict, Field

_NORMAL = NormalDist()


class StepLatency(BaseModel):
    """Delay added to every environment step (off by default: median 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median_s: float = Field(0.0, ge=0.0)
    """Median added delay per step; 0 turns it off (not in the paper: a benchmark setting)."""
    sigma: float = Field(1.0, ge=0.0)
    """Std of log(delay): 0 is a constant delay; 1 puts p99 near 10x the median."""
    max_s: float = Field(60.0, gt=0.0)
    """Cap of one step's delay."""

    @property
    def enabled(self) -> bool:
        return self.median_s > 0


class LogNormalCount(BaseModel):
    """A heavy-tailed count: a log-normal quantile rounded, at least 1 (the caller caps it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(gt=0.0)
    sigma: float = Field(1.0, ge=0.0)
    """Std of log(count): 0 is a constant count."""


class FamilyWorkload(BaseModel):
    """One family's shape in a benchmark (not in the paper). Unset parts keep the loop's own behaviour."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    step_latency: StepLatency | None = None
    """This family's environment step latency instead of agent_loop.step_latency."""
    turns: LogNormalCount | None = None
    """The trajectory's turn budget, drawn per trajectory, at most max_turns (task_limit_reached when spent)."""
    new_tokens: LogNormalCount | None = None
    """The turn's cap on new tokens, drawn per turn, at most max_new_tokens."""


def _quantile(median: float, sigma: float, key: str) -> float:
    """The log-normal quantile at a point of (0, 1) hashed from `key`."""
    digest = hashlib.sha256(key.encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64  # uniform in (0, 1)
    return median * math.exp(sigma * _NORMAL.inv_cdf(u))


def step_delay_s(latency: StepLatency, trajectory_id: str, turn: int) -> float:
    """The delay of `turn` of `trajectory_id`."""
    if not latency.enabled:
        return 0.0
    return min(latency.max_s, _quantile(latency.median_s, latency.sigma, f"{trajectory_id}/{turn}"))


def _drawn(count: LogNormalCount | None, key: str, limit: int) -> int:
    """A count drawn at `key`, within 1 and `limit`; `limit` itself when there is nothing to draw."""
    return limit if count is None else max(1, min(limit, round(_quantile(count.median, count.sigma, key))))


def turn_budget(count: LogNormalCount | None, trajectory_id: str, max_turns: int) -> int:
    """The turns `trajectory_id` may take: max_turns when the family draws none."""
    return _drawn(count, f"{trajectory_id}/turns", max_turns)


def new_tokens_cap(count: LogNormalCount | None, trajectory_id: str, turn: int, max_new_tokens: int) -> int:
    """The new tokens turn `turn` of `trajectory_id` may generate: max_new_tokens when the family draws none."""
    return _drawn(count, f"{trajectory_id}/{turn}/new_tokens", max_new_tokens)
