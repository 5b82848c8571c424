"""The group buffer as a pure state machine: trajectories in, complete groups (or drops) out.

AgentRL trains a group only when all n members have arrived (GRPO needs the whole group). On top
of that this buffer adds what a durable, replayable pipeline needs:

- duplicates (same group_id and member, e.g. an at-least-once redelivery) are dropped;
- a member whose status is `Status.TASK_ERROR` is an infrastructure failure, not a policy failure: it is
  masked (ROLL's Mask & Filter), and the group completes from the other members if at least
  `min_members` remain, else it is dropped;
- a group not complete `group_timeout_s` after its first member arrived is handled by the same
  policy, so one lost member never strands the others (AgentRL's buffer has no such eviction);
- a group whose oldest behaviour version trails the learner by more than `max_staleness` is
  dropped; all-equal reward groups are counted and, with `filter_all_equal`, dropped.

State per group_id is one plain dict (the value of a Faust table, so also its changelog record):

    {"group_id", "run", "task", "split", "sample_index", "group_size", "validation",
     "first_arrival_ms", "members": {"<member>": trajectory dict},
     "arrivals": {"<member>": arrival ms}, "closed": None | "emitted" | "dropped",
     "closed_at_ms": None | int}

Member keys are strings so the dict survives JSON; trajectory dicts hold bytes (the packed token
arrays), so the table needs a bytes-capable value codec. A closed group keeps a small tombstone
(members freed) for `closed_retention_s`, so a late redelivery of one of its members is dropped
instead of opening a new buffer. Functions return new dicts and never mutate their inputs, so the
caller writes the returned state back to the table (which is what makes the changelog see it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.status import Status
from streams.advantages import grpo_advantages, group_reward_stats
from streams.settings import StreamsSettings

# Identity fields every member of a group must agree on.
_GROUP_FIELDS = ("group_id", "run", "task", "split", "sample_index", "group_size", "validation")


class InvalidTrajectory(ValueError):
    """A trajectory that cannot belong to its group (the caller routes it to dlq with this reason)."""


@dataclass(frozen=True)
class AddResult:
    """Outcome of offering one trajectory: "added", "duplicate" or "late" (group already closed)."""

    state: dict[str, Any]
    outcome: str
    counts: dict[str, int]


@dataclass(frozen=True)
class Decision:
    """What to do with a group now: "wait", "emit" (group is the groups event) or "drop"."""

    action: str
    reason: str
    state: dict[str, Any]
    group: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)


def add_member(state: Mapping[str, Any] | None, trajectory: Mapping[str, Any], now_ms: int) -> AddResult:
    """Adds a trajectory to its group's state (None: first member); drops duplicates and late arrivals."""
    member = trajectory["member"]
    if not 0 <= member < trajectory["group_size"]:
        raise InvalidTrajectory(f"member {member} outside 0..{trajectory['group_size'] - 1}")
    if state is None:
        state = {**{k: trajectory[k] for k in _GROUP_FIELDS}, "first_arrival_ms": now_ms,
                 "members": {}, "arrivals": {}, "closed": None, "closed_at_ms": None}
    if state["closed"] is not None:
        return AddResult(dict(state), "late", {"late": 1})
    mismatched = [k for k in _GROUP_FIELDS if trajectory[k] != state[k]]
    if mismatched:
        raise InvalidTrajectory(
            f"trajectory {trajectory['trajectory_id']} disagrees with group {state['group_id']} on "
            + ", ".join(f"{k} ({trajectory[k]!r} != {state[k]!r})" for k in mismatched))
    key = str(member)
    if key in state["members"]:
        return AddResult(dict(state), "duplicate", {"duplicates": 1})
    new_state = {**state, "members": {**state["members"], key: dict(trajectory)},
                 "arrivals": {**state["arrivals"], key: now_ms}}
    return AddResult(new_state, "added", {"added": 1})


def min_weight_version(trajectories: list[Mapping[str, Any]]) -> int | None:
    """Oldest behaviour version over the trajectories' turns; None when no turn was generated."""
    return min((t["weight_version"] for tr in trajectories for t in tr["turns"]), default=None)


def decide(state: Mapping[str, Any], now_ms: int, learner_version: int, settings: StreamsSettings) -> Decision:
    """Decides a group's fate at clock `now_ms` given the learner's latest version.

    Order: staleness first (a stale group never becomes fresh, so it is dropped even while
    incomplete), then completeness (all n present), then the timeout.
    """
    if state["closed"] is not None:
        return Decision("wait", "closed", dict(state))
    members = [state["members"][k] for k in sorted(state["members"], key=int)]
    unmasked = [t for t in members if t["status"] != Status.TASK_ERROR]
    oldest = min_weight_version(unmasked) if unmasked else min_weight_version(members)
    if oldest is not None and learner_version - oldest > settings.max_staleness:
        return _close(state, now_ms, "drop", "stale", {"dropped_stale": 1})

    complete = len(members) == state["group_size"]
    timed_out = now_ms - state["first_arrival_ms"] >= settings.group_timeout_s * 1000
    if not complete and not timed_out:
        return Decision("wait", "waiting", dict(state))
    timeout_count = {} if complete else {"timeouts": 1}
    if len(unmasked) < settings.min_members:
        return _close(state, now_ms, "drop", "too_few_members",
                      {"dropped_too_few_members": 1, **timeout_count})

    completion = "timeout" if not complete else ("masked" if len(unmasked) < len(members) else "complete")
    group = build_group(state, members, now_ms, completion, settings)
    all_equal_count = {"all_equal": 1} if group["all_equal"] else {}
    if group["all_equal"] and settings.filter_all_equal:
        return _close(state, now_ms, "drop", "all_equal",
                      {"dropped_all_equal": 1, **all_equal_count, **timeout_count})
    counts = {f"emitted_{completion}": 1, "masked_members": len(members) - len(unmasked),
              **all_equal_count, **timeout_count}
    return _close(state, now_ms, "emit", completion, counts, group)


def build_group(state: Mapping[str, Any], members: list[Mapping[str, Any]], now_ms: int, completion: str,
                settings: StreamsSettings) -> dict[str, Any]:
    """The groups event (schemas/avro/group.avsc): members in member order, masked ones with
    advantage 0 (every one with settings.advantage "none"). all_equal needs at least two unmasked
    members (a group of one has advantage R)."""
    masked = np.array([t["status"] == Status.TASK_ERROR for t in members])
    rewards = np.array([t["reward"] for t in members], dtype=np.float64)
    if settings.advantage == "group":
        adv = grpo_advantages(rewards, [state["group_id"]] * len(members), settings.std, settings.eps, ~masked)
    else:  # "none": the learner computes the advantages from the rewards (SAO)
        adv = np.zeros(len(members), dtype=np.float64)
    counted = rewards[~masked]
    _, used_std = group_reward_stats(counted, settings.std)
    unmasked_versions = min_weight_version([t for t, m in zip(members, masked) if not m])
    oldest = unmasked_versions if unmasked_versions is not None else min_weight_version(list(members))
    return {
        "group_id": state["group_id"],
        "run": state["run"],
        "task": state["task"],
        "split": state["split"],
        "sample_index": state["sample_index"],
        "group_size": state["group_size"],
        "validation": state["validation"],
        "completion": completion,
        "members": [{"trajectory": dict(t), "advantage": float(a), "masked": bool(m)}
                    for t, a, m in zip(members, adv, masked)],
        "reward_mean": float(counted.mean()),
        "reward_std": float(used_std),
        "all_equal": bool(len(counted) >= 2 and np.all(counted == counted[0])),
        # -1: no member generated a single turn, so there is no behaviour version to report
        "min_weight_version": oldest if oldest is not None else -1,
        "first_arrival_ms": state["first_arrival_ms"],
        "last_arrival_ms": max(state["arrivals"][str(t["member"])] for t, m in zip(members, masked) if not m),
        "ready_at_ms": now_ms,
    }


def _close(state: Mapping[str, Any], now_ms: int, action: str, reason: str, counts: dict[str, int],
           group: dict[str, Any] | None = None) -> Decision:
    outcome = "emitted" if action == "emit" else "dropped"
    tombstone = {**state, "members": {}, "arrivals": {}, "closed": outcome, "closed_at_ms": now_ms}
    return Decision(action, reason, tombstone, group, {outcome: 1, **counts})


def sweep(states: Mapping[str, Mapping[str, Any]], now_ms: int, learner_version: int,
          settings: StreamsSettings) -> dict[str, Decision]:
    """Decisions for every open group that is due now (timed out or stale), by group_id; the
    periodic timer calls this, since a group whose last member is lost receives no more events."""
    due = {}
    for group_id, state in states.items():
        decision = decide(state, now_ms, learner_version, settings)
        if decision.action != "wait":
            due[group_id] = decision
    return due


def expired_tombstones(states: Mapping[str, Mapping[str, Any]], now_ms: int, settings: StreamsSettings) -> list[str]:
    """Group ids of closed groups older than closed_retention_s, which the caller may delete."""
    return [gid for gid, s in states.items()
            if s["closed"] is not None and now_ms - s["closed_at_ms"] >= settings.closed_retention_s * 1000]


# -- counters -------------------------------------------------------------------------------

def tally(counters: Mapping[str, float], counts: Mapping[str, float]) -> dict[str, float]:
    """Adds a result's counts to running counters (a plain dict, so it can live in a table)."""
    out = dict(counters)
    for name, n in counts.items():
        out[name] = out.get(name, 0) + n
    return out


def dropped_share(counters: Mapping[str, int]) -> float:
    """Dropped groups / closed groups (0 when none closed)."""
    closed = counters.get("emitted", 0) + counters.get("dropped", 0)
    return counters.get("dropped", 0) / closed if closed else 0.0


def dropped_share_exceeded(counters: Mapping[str, int], settings: StreamsSettings) -> bool:
    """True when the dropped share is above the cap: the caller reports it (metric and log)."""
    return dropped_share(counters) > settings.max_dropped_share
