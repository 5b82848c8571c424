"""Added environment step latency, for benchmarks: what a slow tool, a remote sandbox or a web
page costs per turn, on environments that answer in microseconds here.

Log-normal (AgentRL's and ROLL's measurements of agentic environments: most steps fast, a heavy
tail of slow ones): `median_s` and `sigma` (the std of the log; sigma 1 puts the 99th percentile at
about 10x the median), capped at `max_s`. The delay of a turn is a pure function of (trajectory id,
turn), so a re-rollout waits as long as the first rollout did and two benchmark modes given the
same tasks see the same latencies.
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


def step_delay_s(latency: StepLatency, trajectory_id: str, turn: int) -> float:
    """The delay of `turn` of `trajectory_id`: a log-normal quantile at a point hashed from both."""
    if not latency.enabled:
        return 0.0
    digest = hashlib.sha256(f"{trajectory_id}/{turn}".encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64  # uniform in (0, 1)
    return min(latency.max_s, latency.median_s * math.exp(latency.sigma * _NORMAL.inv_cdf(u)))
