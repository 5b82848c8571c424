"""`rollstream bench envs`, the part that builds no environment itself: which measurements a
family list makes, how sessions of a given environment are timed, how a family that cannot run
becomes a reason instead of an error, and the report's median and ratio.

Environments and their samples are passed in (the command builds them from the registry), so the
rules can be tested with any Environment.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from env_workers.envs.base import Environment

# family -> the split its samples come from (the smallest shipped one)
FAMILY_SPLITS = {"calc": "dev", "db": "dev", "kg": "dev", "webshop": "generated-dev", "alfworld": "dev", "os": "test"}
OS_BACKENDS = ("docker", "bwrap")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def labels(families: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """(label, family, sandbox backend) of each measurement: os once per sandbox backend."""
    out: list[tuple[str, str, str | None]] = []
    for name in families:
        if name == "os":
            out += [(f"os/{b}", "os", b) for b in OS_BACKENDS]
        else:
            out.append((name, name, None))
    return out


async def timed(n: int, concurrency: int, one: Callable[[int], Awaitable[float]]) -> tuple[list[float], float]:
    """Runs `one(i)` for i < n, `concurrency` at a time: the per-call figures and the wall time in seconds."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> float:
        async with gate:
            return await one(i)

    start = time.perf_counter()
    figures = await asyncio.gather(*(gated(i) for i in range(n)))
    return list(figures), time.perf_counter() - start


async def family_sessions(env: Environment, samples: Sequence[Mapping[str, Any]], n: int,
                          concurrency: int) -> dict[str, Any]:
    """Session start latency (ms) one at a time and sessions/s (start + end) with `concurrency` in flight."""

    async def start_only(i: int) -> float:
        start = time.perf_counter()
        session = await env.start(samples[i % len(samples)])
        elapsed = (time.perf_counter() - start) * 1000
        await env.end(session)
        return elapsed

    async def start_and_end(i: int) -> float:
        session = await env.start(samples[i % len(samples)])
        await env.end(session)
        return 0.0

    first = await start_only(0)
    latencies, _ = await timed(n, 1, start_only)
    _, wall = await timed(n, concurrency, start_and_end)
    return {"measured": True, "sessions": n, "first_start_ms": first, "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "sessions_per_s": n / wall}


async def measure(open_family: Callable[[], tuple[Environment, Sequence[Mapping[str, Any]]]], n: int,
                  concurrency: int, timeout_s: float) -> dict[str, Any]:
    """One family's figures, or {measured: false, reason} when it cannot run here: `open_family`
    (its environment and samples) or a session fails, or the sessions exceed `timeout_s`."""
    try:
        env, samples = open_family()
        return await asyncio.wait_for(family_sessions(env, samples, n, concurrency), timeout_s)
    except TimeoutError:
        return {"measured": False, "reason": f"did not finish within {timeout_s:g} s"}
    except Exception as error:  # a missing module, sandbox or data: reported, not raised
        return {"measured": False, "reason": f"{type(error).__name__}: {error}"}


def summary(bare: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report: the bare process, every family, and the median of the families' p50 over the bare p50."""
    measured = [r["p50_ms"] for r in results.values() if r["measured"]]
    median = statistics.median(measured) if measured else None
    return {"bare_process": bare, "families": results, "median_family_p50_ms": median,
            "ratio": median / bare["p50_ms"] if measured else None}
