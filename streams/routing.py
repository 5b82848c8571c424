"""Stale-engine routing (AgentRL cross-policy sampling) and the engine registry, as pure logic.

Every turn of every trajectory goes to the stale pool with probability stale_ratio, else to the
current pool (routing mode "turn", the paper's). The router draws the whole per-turn plan up front
from a seed derived from (run, group_id, member) with sha256, so a replay of tasks.requested
reproduces every plan (Python's hash() is salted per process and would not). Routing mode
"trajectory" (the paper's trajectory-level mixing ablation) draws once from the same seed and
gives every turn of the trajectory that one pool. stale_ratio 0 gives every turn the current pool.

The registry folds `engines` heartbeats (schemas/avro/engine_heartbeat.avsc) into a plain dict
keyed by engine_id — the value a Faust table would hold — and summarizes it per pool at a given
clock reading `now_ms`; nothing here reads a clock.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streams.settings import RoutingMode

CURRENT = "current"
STALE = "stale"
POOLS = (CURRENT, STALE)

REASON_MIXED = "mixed"
REASON_VALIDATION = "validation"
REASON_NO_STALE_ENGINE = "no healthy stale engine"
REASON_STALE_BEHIND = "stale pool too far behind"
REASON_RATIO_ZERO = "stale_ratio is 0"


@dataclass(frozen=True)
class PoolState:
    """Live engines of one pool: their ids and the oldest weight version any of them has loaded."""

    engines: tuple[str, ...]
    loaded_version: int | None  # min over live engines; None when the pool has none

    @property
    def healthy(self) -> bool:
        return bool(self.engines)


@dataclass(frozen=True)
class RoutingPlan:
    """The per-turn pool plan of one task member (fields map onto schemas/avro/task.avsc)."""

    turn_pools: list[str]
    seed: int
    stale_ratio: float
    reason: str
    stale_version: int | None


def routing_seed(run: str, group_id: str, member: int) -> int:
    """Deterministic non-negative 63-bit seed (fits Avro's signed long) from (run, group_id, member)."""
    digest = hashlib.sha256(f"{run}\x1f{group_id}\x1f{member}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def stale_schedule(learner_version: int, stale_step: int) -> int:
    """The version the stale pool should hold: the latest multiple of stale_step <= learner_version."""
    return (learner_version // stale_step) * stale_step


def turn_budget(learner_version: int, schedule: Sequence[tuple[int, int]], max_turns: int) -> int:
    """Turns a training task routed at `learner_version` may take: ScalingInter-RL's staged horizon
    (AgentGym-RL, arXiv 2509.08755), the budget of the last stage (from_version, turns) starting at
    or before that version; max_turns without a schedule (StreamsSettings.turn_schedule)."""
    budget = max_turns
    for from_version, turns in schedule:
        if from_version > learner_version:
            break
        budget = turns
    return budget


def plan_turn_pools(
    run: str,
    group_id: str,
    member: int,
    max_turns: int,
    stale_ratio: float,
    stale_pool: PoolState | None,
    validation: bool,
    max_stale_lag: int,
    *,
    learner_version: int,
    stale_step: int,
    mode: RoutingMode = "turn",
) -> RoutingPlan:
    """Draws the pool of each of max_turns turns ("turn" mode) or one pool for all of them
    ("trajectory" mode), or falls back to current-only with a reason.

    Current-only when: the task is a validation task; stale_ratio is 0; the stale pool has no live
    healthy engine; or its oldest loaded version trails stale_schedule(learner_version) by more
    than max_stale_lag. The seed is always derived, so the plan records it even when unused.
    """
    seed = routing_seed(run, group_id, member)
    stale_version = stale_pool.loaded_version if stale_pool is not None else None
    reason = _current_only_reason(
        stale_ratio, stale_pool, validation, max_stale_lag, learner_version, stale_step)
    if reason is not None:
        return RoutingPlan([CURRENT] * max_turns, seed, 0.0, reason, stale_version)
    rng = random.Random(seed)
    if mode == "trajectory":
        pools = [STALE if rng.random() < stale_ratio else CURRENT] * max_turns
    else:
        pools = [STALE if rng.random() < stale_ratio else CURRENT for _ in range(max_turns)]
    return RoutingPlan(pools, seed, stale_ratio, REASON_MIXED, stale_version)


def _current_only_reason(
    stale_ratio: float,
    stale_pool: PoolState | None,
    validation: bool,
    max_stale_lag: int,
    learner_version: int,
    stale_step: int,
) -> str | None:
    if validation:
        return REASON_VALIDATION
    if stale_ratio <= 0:
        return REASON_RATIO_ZERO
    if stale_pool is None or not stale_pool.healthy or stale_pool.loaded_version is None:
        return REASON_NO_STALE_ENGINE
    if stale_schedule(learner_version, stale_step) - stale_pool.loaded_version > max_stale_lag:
        return REASON_STALE_BEHIND
    return None


def task_event(request: dict[str, Any], plan: RoutingPlan, routed_at_ms: int) -> dict[str, Any]:
    """The `tasks` event (schemas/avro/task.avsc) for a task_requested dict and its plan."""
    return {
        "request": request,
        "turn_pools": list(plan.turn_pools),
        "routing_seed": plan.seed,
        "stale_ratio": plan.stale_ratio,
        "routing_reason": plan.reason,
        "stale_version": plan.stale_version,
        "routed_at_ms": routed_at_ms,
        "max_turns": len(plan.turn_pools),  # one planned pool per turn the task may take
    }


# -- engine registry ------------------------------------------------------------------------

def fold_heartbeat(registry: Mapping[str, dict[str, Any]], heartbeat: dict[str, Any],
                   forget_after_ms: int | None = None) -> dict[str, dict[str, Any]]:
    """Returns the registry with this heartbeat applied; an older heartbeat than the one held for
    the engine (out-of-order delivery, replay) is ignored, so folding is order-insensitive.

    forget_after_ms: engines whose last heartbeat is that much older than this one leave the
    registry (an engine replaced by a restart under a new id never beats again, and the registry
    is rewritten whole with every heartbeat); one that comes back is added again by its next."""
    held = registry.get(heartbeat["engine_id"])
    if held is not None and held["sent_at_ms"] > heartbeat["sent_at_ms"]:
        return dict(registry)
    kept = registry if forget_after_ms is None else {
        engine: hb for engine, hb in registry.items() if heartbeat["sent_at_ms"] - hb["sent_at_ms"] <= forget_after_ms}
    return {**kept, heartbeat["engine_id"]: dict(heartbeat)}


ROUTED_FIELDS = ("pool", "healthy", "loaded_version", "run")
"""What the router reads of a heartbeat besides its age (pool_states, serves_run)."""


def is_news(forwarded: Mapping[str, Any] | None, heartbeat: Mapping[str, Any], refresh_ms: int) -> bool:
    """Whether the router needs this heartbeat, given the engine's last one forwarded to it: the
    engine is new to it, something the router reads changed, or the last one forwarded is
    `refresh_ms` old. Engines beat every few seconds while the router only needs to know them live
    within the liveness timeout, and each heartbeat forwarded is written into every partition."""
    if forwarded is None:
        return True
    if heartbeat["sent_at_ms"] < forwarded["sent_at_ms"]:
        return False  # older than what the router holds: fold_heartbeat ignores it
    return (any(heartbeat[f] != forwarded[f] for f in ROUTED_FIELDS)
            or heartbeat["sent_at_ms"] - forwarded["sent_at_ms"] >= refresh_ms)


def serves_run(heartbeat: Mapping[str, Any], run: str | None) -> bool:
    """Whether a heartbeat's engine may be routed turns of `run` (None: any run): it serves that run,
    or names none (heartbeats written before they carried a run)."""
    return run is None or heartbeat["run"] in ("", run)


def is_live(heartbeat: Mapping[str, Any], now_ms: int, liveness_ms: int) -> bool:
    """Healthy at its last probe, and that heartbeat is no older than the liveness timeout."""
    return bool(heartbeat["healthy"]) and now_ms - heartbeat["sent_at_ms"] <= liveness_ms


def pool_states(registry: Mapping[str, Mapping[str, Any]], now_ms: int, liveness_ms: int) -> dict[str, PoolState]:
    """Per pool ("current", "stale"): live engines (sorted ids) and their oldest loaded version."""
    live: dict[str, list[Mapping[str, Any]]] = {pool: [] for pool in POOLS}
    for hb in registry.values():
        if is_live(hb, now_ms, liveness_ms):
            live[hb["pool"]].append(hb)
    return {
        pool: PoolState(
            engines=tuple(sorted(hb["engine_id"] for hb in hbs)),
            loaded_version=min((hb["loaded_version"] for hb in hbs), default=None),
        )
        for pool, hbs in live.items()
    }
