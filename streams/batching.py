"""Batch cutting as pure logic: which ready groups form the next training batch, and the batch.

AgentRL's asynchronous rule: when the learner asks for a batch (its credit), take *all* ready
trajectories, provided there are at least min_trajectories (batch_size * n; the first batch waits
for first_batch_factor times that), rounded down to a multiple of lcm(n, data_parallel_multiple).

Groups are never split: GRPO advantages are relative to the group, and training half a group
would bias them. So selection walks the ready groups in arrival order and takes each whole group
that still fits under the rounded-down count; a group that would straddle it (and any later
group that does not fit) stays ready for the next batch. With full groups of n the batch is
exactly the rounded count; masked groups (fewer than n trainable members) can leave it a few
trajectories below, never above. Masked members are not trained and are not counted.

The cut condition is on what is ready (as the paper states it), not on what the rounding
leaves: with masked groups, or a multiple that does not divide min_trajectories, a batch can
hold a few trajectories fewer than the minimum rather than wait for another whole round.

Batch construction options (StreamsSettings; all off by default, ARCHITECTURE.md "Batch
construction options"), in the order a cut applies them:
1. windowed FIFO (`fifo_window_s`): ready groups older than the window are dropped before the
   plan, so they never take a fresh group's place (`split_by_window`);
2. RAGEN's variance filter (`variance_filter_keep`): of the planned groups only the fraction of
   largest reward std is trained (`variance_filter`);
3. ERPO normalization (`adv_norm`), the positive-only start (`positive_only_steps`) and the
   per-family scale (`task_advantage_scale`) change the advantages of the batch, not its groups
   (`build_batch`, streams/advantages.py).
A dropped group is still consumed by the cut (never offered again) and reported with a
`streams/group_dropped` metric (`dropped_metric`), which releases it at the dispatcher as an
aggregator's drop does; groups stay whole throughout.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas import topics
from schemas.arrays import unpack_mask
from schemas.ids import batch_id
from streams.advantages import batch_advantages, weighted_mean_std
from streams.settings import StreamsSettings

WINDOW_REASON, VARIANCE_REASON = "fifo_window", "variance_filter"
"""The `reason` label of a group dropped by the windowed FIFO or by the variance filter."""


@dataclass(frozen=True)
class BatchPlan:
    """Whether to cut now; `groups` is the selection (arrival order), `remaining` stays ready."""

    cut: bool
    reason: str
    groups: list[dict[str, Any]]
    remaining: list[dict[str, Any]]
    trajectories: int


def trainable_members(group: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Members of a group that are trained on (not masked)."""
    return [m for m in group["members"] if not m["masked"]]


def required_trajectories(batch_index: int, settings: StreamsSettings) -> int:
    """Trajectories batch number `batch_index` (from 0) waits for: the first waits for 1.7x."""
    return settings.first_batch_trajectories if batch_index == 0 else settings.min_trajectories


def wait_reason(available: int, credit_version: int | None, batch_index: int, settings: StreamsSettings) -> str | None:
    """Why batch `batch_index` is not cut yet with `available` trainable trajectories ready, or
    None when it is cut now. Cheap, so a caller that keeps the count can ask before gathering
    the ready groups."""
    if credit_version is None:
        return "no credit"
    required = required_trajectories(batch_index, settings)
    if available < required:
        return f"waiting: {available} of {required} trajectories ready"
    return None


def plan_batch(ready: Sequence[dict[str, Any]], credit_version: int | None, batch_index: int,
               settings: StreamsSettings) -> BatchPlan:
    """Decides whether to cut batch `batch_index` from the ready groups (arrival order).

    credit_version is the learner version that asked for a batch and has not been answered yet
    (None: no outstanding request, so nothing is cut). Validation groups must not be offered.
    """
    if any(g["validation"] for g in ready):
        raise ValueError("validation groups are never batched; do not offer them to the batcher")
    available = sum(len(trainable_members(g)) for g in ready)
    reason = wait_reason(available, credit_version, batch_index, settings)
    if reason is not None:
        return BatchPlan(False, reason, [], list(ready), 0)
    multiple = settings.trajectory_multiple
    target = available // multiple * multiple
    taken: list[dict[str, Any]] = []
    left: list[dict[str, Any]] = []
    count = 0
    for g in ready:
        size = len(trainable_members(g))
        if count + size <= target:
            taken.append(g)
            count += size
        else:
            left.append(g)
    return BatchPlan(True, "cut", taken, left, count)


def split_by_window(ready: Sequence[Mapping[str, Any]], now_ms: int, settings: StreamsSettings
                    ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(inside the window, expired), each in the given order: a group is expired when its first
    member arrived more than fifo_window_s before `now_ms` (the clock of the aggregator that stamped
    first_arrival_ms, so no worker's clock is compared with another's). A queue entry written before
    it carried first_arrival_ms counts as inside. No window: every group is inside."""
    if settings.fifo_window_s is None:
        return list(ready), []
    horizon_ms = settings.fifo_window_s * 1000
    inside: list[Mapping[str, Any]] = []
    expired: list[Mapping[str, Any]] = []
    for g in ready:
        arrived = g.get("first_arrival_ms")
        (expired if arrived is not None and now_ms - arrived > horizon_ms else inside).append(g)
    return inside, expired


def group_reward_std(group: Mapping[str, Any], settings: StreamsSettings) -> float:
    """Std of the rewards of a group's trainable members (0 for one member), settings.std kind."""
    rewards = np.array([m["trajectory"]["reward"] for m in trainable_members(group)], dtype=np.float64)
    return weighted_mean_std(rewards, np.ones(len(rewards)), settings.std)[1]


def variance_filter(groups: Sequence[Mapping[str, Any]], settings: StreamsSettings
                    ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(kept, filtered), each in arrival order. RAGEN's top-k rollout filter keeps the
    int(ratio * groups) groups of largest reward std, at least one; here the count is taken in
    trajectories so the batch stays a multiple of trajectory_multiple: the groups of largest std
    (ties: earlier arrival first) are kept whole while they fit under
    max(multiple, floor(keep * trajectories / multiple) * multiple). With full groups and the
    multiple equal to group_size this is exactly RAGEN's group count."""
    if settings.variance_filter_keep >= 1.0:
        return list(groups), []
    sizes = [len(trainable_members(g)) for g in groups]
    multiple = settings.trajectory_multiple
    # round first, as first_batch_trajectories does: 0.7 * 10 must not become 6.999...
    share = math.floor(round(settings.variance_filter_keep * sum(sizes), 9))
    target = max(multiple, share // multiple * multiple)
    stds = [group_reward_std(g, settings) for g in groups]
    kept: set[int] = set()
    count = 0
    for i in sorted(range(len(groups)), key=lambda i: (-stds[i], i)):
        if count + sizes[i] <= target:
            kept.add(i)
            count += sizes[i]
    return ([g for i, g in enumerate(groups) if i in kept],
            [g for i, g in enumerate(groups) if i not in kept])


def dropped_metric(run: str, group: Mapping[str, Any], reason: str, step: int | None, now_ms: int) -> dict[str, Any]:
    """The `streams/group_dropped` metric of a group a cut drops (labels as the aggregator's drops)."""
    return {"run": run, "name": topics.GROUP_DROPPED_METRIC, "value": 1.0, "step": step,
            "labels": {"group_id": group["group_id"], "reason": reason, "task": group.get("task", "")},
            "source": "streams/batcher", "at_ms": now_ms}


def action_tokens(trajectory: Mapping[str, Any]) -> int:
    """Tokens with loss_mask 1. When the arrays were offloaded (arrays_uri set, loss_mask empty)
    the per-turn lengths, which count exactly those tokens, stand in for the mask."""
    if trajectory["arrays_uri"] is None:
        return int(unpack_mask(trajectory["loss_mask"]).sum())
    return sum(t["length"] for t in trajectory["turns"])


def build_batch(run: str, index: int, credit_version: int, groups: Sequence[Mapping[str, Any]],
                settings: StreamsSettings, now_ms: int) -> dict[str, Any]:
    """The batches event (schemas/avro/batch.avsc): unmasked members with their GRPO advantage
    and their final advantage after per-task token-weighted normalization (tasks sorted by name),
    or, with settings.task_adv_norm off, the GRPO advantage unchanged; with settings.adv_norm
    "erpo" the ERPO advantage instead, and in the first positive_only_steps batches max(A, 0); each
    family's advantages then times its settings.task_advantage_scale."""
    members = [m for g in groups for m in trainable_members(g)]
    tasks: list[Hashable] = [m["trajectory"]["task"] for m in members]
    group_adv = [m["advantage"] for m in members]
    final, stats = batch_advantages(
        group_adv, [m["trajectory"]["reward"] for m in members], [m["trajectory"]["group_id"] for m in members],
        tasks, [action_tokens(m["trajectory"]) for m in members], std=settings.std, eps=settings.eps,
        normalize=settings.task_adv_norm, adv_norm=settings.adv_norm, positive_only=index < settings.positive_only_steps,
        task_scale=settings.task_advantage_scale)
    group_ids = [g["group_id"] for g in groups]
    return {
        "batch_id": batch_id(run, group_ids),
        "run": run,
        "index": index,
        "credit_version": credit_version,
        "group_ids": group_ids,
        "items": [{"trajectory": m["trajectory"], "group_advantage": float(m["advantage"]),
                   "advantage": float(a)} for m, a in zip(members, final)],
        "task_stats": [{"task": task, **stats[task].as_dict()} for task in sorted(stats)],
        "created_at_ms": now_ms,
        # inline; the batcher agent turns a batch too large for one message into a claim check
        "payload_uri": None, "payload_sha256": None, "payload_bytes": None,
    }
