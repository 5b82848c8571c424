"""`rollstream bench envs`, the part that builds no environment itself: which measurements a
family list makes, how sessions of a given environment are timed, how a family that cannot run
becomes a reason instead of an error, and the report's median and ratio.

The held phase (`held_sessions`) keeps N sessions of one family open at the same time, as one env
worker holds them: it opens them with a bounded number of starts in flight, takes the family's
oracle actions in every one, ends them all, and reports start latency under that load, steps/s,
memory per session, what stopped it short of N (a failing start, the memory guard, the time
limit) and what the sessions left behind once ended (which must be nothing).

Environments, their samples and the machine's readings (`Host`) are passed in (the command builds
them from the registry and /proc), so the rules can be tested with any Environment.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from env_workers.envs.base import Environment, Observation, Policy, Session, Status

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
                  concurrency: int, timeout_s: float, held: Held | None = None) -> dict[str, Any]:
    """One family's figures, or {measured: false, reason} when it cannot run here: `open_family`
    (its environment and samples) or a session fails, or the sessions exceed `timeout_s`. With
    `held`, then the held phase under `held` (its own `timeout_s` for opening), as figures["held"]."""
    try:
        env, samples = open_family()
        figures = await asyncio.wait_for(family_sessions(env, samples, n, concurrency), timeout_s)
    except TimeoutError:
        return {"measured": False, "reason": f"did not finish within {timeout_s:g} s"}
    except Exception as error:  # a missing module, sandbox or data: reported, not raised
        return {"measured": False, "reason": f"{type(error).__name__}: {error}"}
    if held is not None:
        try:
            figures["held"] = await held_sessions(env, samples, held, timeout_s)
        except Exception as error:  # e.g. an oracle that cannot act: the figures above still stand
            figures["held"] = {"sessions": held.sessions, "reached": 0,
                               "stopped_by": f"{type(error).__name__}: {error}", "clean": None}
    return figures


def summary(bare: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report: the bare process, every family, and the median of the families' p50 over the bare p50."""
    measured = [r["p50_ms"] for r in results.values() if r["measured"]]
    median = statistics.median(measured) if measured else None
    return {"bare_process": bare, "families": results, "median_family_p50_ms": median,
            "ratio": median / bare["p50_ms"] if measured else None}


# --- the held phase: N sessions open at the same time ------------------------------------------

KIB = 1024


@dataclass(frozen=True)
class Memory:
    """One reading, in bytes: this process's RSS, the RSS of its descendants summed (a sandbox's
    processes; pages they share count once per process, so it is an upper bound) and the host's
    MemAvailable."""

    rss: int
    children_rss: int
    available: int


class Host(Protocol):
    """What the held phase reads of the machine: pipeline/bench/envs.py reads /proc, tests fake it."""

    def memory(self) -> Memory: ...

    def available(self) -> int:
        """MemAvailable alone, read before every start (so it must be cheap)."""
        ...

    def leftovers(self) -> Mapping[str, frozenset[str]]:
        """What sessions can leave behind, by kind (processes, fds, mounts, temp dirs, ...): the
        names of those present now, so that what the phase added is a set difference."""
        ...


@dataclass(frozen=True)
class Held:
    """How the held phase runs: `sessions` open at the same time, started `concurrency` at a time
    (steps and ends too); `steps` rounds of the family's oracle (`policy`: its golden policy) in
    every open session; no start once `guard` of the MemAvailable read at the phase's start is used.
    `host` reads the machine around the family's environment once that exists."""

    sessions: int
    concurrency: int
    steps: int
    guard: float
    policy: Callable[[Mapping[str, Any]], Policy]
    host: Callable[[Environment], Host]
    on_open: Callable[[int, int], None] = lambda opened, wanted: None


def guard_stop(available_at_start: int, available_now: int, guard: float) -> str | None:
    """Why no further session may start, or None: the host has lost `guard` of the memory that was
    available when the phase began (whoever took it: on a shared machine, other work counts too)."""
    used = available_at_start - available_now
    if used < guard * available_at_start:
        return None
    return (f"memory guard: {used / 2**20:.0f} MiB of the {available_at_start / 2**20:.0f} MiB available "
            f"at the start used (limit {guard:.0%})")


def memory_per_session(before: Memory, held: Memory, sessions: int) -> dict[str, float | None]:
    """KiB each open session costs: this process's RSS growth, its descendants' (sandbox processes)
    and the host's MemAvailable drop (tmpfs and kernel objects included, and any other work on the
    host), each over the `sessions` open; None when none opened."""

    def per(grown: int) -> float | None:
        return grown / sessions / KIB if sessions else None

    return {"rss_kib": per(held.rss - before.rss),
            "children_rss_kib": per(held.children_rss - before.children_rss),
            "available_drop_kib": per(before.available - held.available),
            "rss_mib_before": before.rss / 2**20, "rss_mib_held": held.rss / 2**20}


def leftover_counts(before: Mapping[str, frozenset[str]], after: Mapping[str, frozenset[str]]) -> dict[str, int]:
    """How many things of each kind exist after the sessions ended that did not before they began."""
    return {kind: len(names - before.get(kind, frozenset())) for kind, names in after.items()}


def held_summary(wanted: int, stopped_by: str | None, start_ms: Sequence[float], open_s: float,
                 step_ms: Sequence[float], step_s: float, step_task_errors: int, end_s: float,
                 memory: Mapping[str, float | None], sessions_open: int,
                 leftovers: Mapping[str, int]) -> dict[str, Any]:
    """One family's held figures. `reached` is how many were open at once (every start that
    succeeded: none ends before the steps); `clean` when every session ended and nothing is left."""
    def quantile(values: Sequence[float], q: float) -> float | None:
        return percentile(values, q) if values else None  # None, not NaN: the report stays valid JSON

    cleanup = {"sessions_open": sessions_open, **leftovers}
    return {"sessions": wanted, "reached": len(start_ms), "stopped_by": stopped_by,
            "start_p50_ms": quantile(start_ms, 50), "start_p99_ms": quantile(start_ms, 99), "open_s": open_s,
            "steps": len(step_ms), "steps_per_s": len(step_ms) / step_s if step_s > 0 else None,
            "step_p50_ms": quantile(step_ms, 50), "step_p99_ms": quantile(step_ms, 99),
            "step_task_errors": step_task_errors, "end_s": end_s, "memory": dict(memory),
            "cleanup": cleanup, "clean": not any(cleanup.values())}


async def _open_all(env: Environment, samples: Sequence[Mapping[str, Any]], held: Held, host: Host,
                    timeout_s: float, sessions: list[Session], start_ms: list[float]) -> str | None:
    """Starts up to `held.sessions` sessions into `sessions` (their start latencies into `start_ms`),
    `held.concurrency` in flight; why it stopped short, or None. Each start is launched only once
    the guard and the time limit allow it, so neither is overshot by more than the starts in flight."""
    gate = asyncio.Semaphore(held.concurrency)
    failures: list[str] = []
    available_at_start = host.available()
    deadline = time.perf_counter() + timeout_s

    async def start_one(sample: Mapping[str, Any]) -> None:
        try:
            began = time.perf_counter()
            session = await env.start(sample)
            start_ms.append((time.perf_counter() - began) * 1000)
            sessions.append(session)
            held.on_open(len(sessions), held.sessions)
        except Exception as error:  # where the family stops, not a crash of the bench
            failures.append(f"a start failed: {type(error).__name__}: {error}")
        finally:
            gate.release()

    stop: str | None = None
    launched: list[asyncio.Future[None]] = []
    try:
        for i in range(held.sessions):
            await gate.acquire()
            if failures:
                stop = failures[0]
            elif time.perf_counter() > deadline:
                stop = f"time: {len(sessions)} open after --timeout-s {timeout_s:g} s"
            else:
                stop = guard_stop(available_at_start, host.available(), held.guard)
            if stop is not None:
                gate.release()
                break
            launched.append(asyncio.ensure_future(start_one(samples[i % len(samples)])))
    finally:
        # Every launched start is waited for, so that what it opened is in `sessions` and gets ended.
        await asyncio.gather(*launched, return_exceptions=True)
    return stop or (failures[0] if failures else None)


async def _step_all(env: Environment, sessions: Sequence[Session], held: Held) -> tuple[list[float], float, int]:
    """`held.steps` rounds of oracle actions in every session still running: each step's latency
    (ms), the rounds' wall time in seconds (the oracle's own work is outside it) and the steps that
    ended in task_error (an environment that broke under the load)."""
    policies: dict[str, Policy] = {}  # one per task: a policy is a function of the conversation alone
    histories = [list(session.messages) for session in sessions]
    step_ms: list[float] = []
    wall, task_errors = 0.0, 0
    for _ in range(held.steps):
        live = [i for i, session in enumerate(sessions) if not session.finished]
        if not live:
            break
        actions = []
        for i in live:
            sample = sessions[i].sample
            key = str(sample.get("id"))
            if key not in policies:
                policies[key] = held.policy(sample)
            actions.append(policies[key](histories[i]))
        observations: list[Observation | None] = [None] * len(live)

        async def step(j: int) -> float:
            began = time.perf_counter()
            observations[j] = await env.observation(sessions[live[j]], actions[j])
            return (time.perf_counter() - began) * 1000

        latencies, round_s = await timed(len(live), held.concurrency, step)
        step_ms += latencies
        wall += round_s
        for j, i in enumerate(live):
            observation = observations[j]
            assert observation is not None
            histories[i] += [actions[j], *observation.messages]
            task_errors += observation.status == Status.TASK_ERROR
    return step_ms, wall, task_errors


async def held_sessions(env: Environment, samples: Sequence[Mapping[str, Any]], held: Held,
                        timeout_s: float) -> dict[str, Any]:
    """Opens `held.sessions` sessions so that all are open at once (stopping short at a failing
    start, the memory guard or `timeout_s` of opening), steps every one, ends them all (also when
    a step raises or this is cancelled) and reports the figures of `held_summary`."""
    host = held.host(env)
    leftovers_before = host.leftovers()
    before = host.memory()
    sessions: list[Session] = []
    start_ms: list[float] = []
    try:
        began = time.perf_counter()
        stopped_by = await _open_all(env, samples, held, host, timeout_s, sessions, start_ms)
        open_s = time.perf_counter() - began
        memory = memory_per_session(before, host.memory(), len(sessions))
        step_ms, step_s, task_errors = await _step_all(env, sessions, held)
    finally:
        began = time.perf_counter()

        async def end(i: int) -> float:
            await env.end(sessions[i])  # never raises: a failure to release is logged
            return 0.0

        await timed(len(sessions), held.concurrency, end)
        end_s = time.perf_counter() - began
    leftovers = leftover_counts(leftovers_before, host.leftovers())
    return held_summary(held.sessions, stopped_by, start_ms, open_s, step_ms, step_s, task_errors, end_s, memory,
                        sum(not session.ended for session in sessions), leftovers)
