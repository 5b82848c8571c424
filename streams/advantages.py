"""GRPO group advantages and per-task token-weighted advantage normalization (AgentRL).

1. GRPO, as AgentRL's code computes it: A_g = (R_g - mean(R)) / (std(R) + eps) within each group,
   std Bessel-corrected by default (torch's default); a group of one uses mean 0 and std 1, so its
   advantage is R / (1 + eps). Masked members (infrastructure failures) take no part and get 0.
2. Task normalization, as AgentRL's adv_norm: within one batch, for each task (data_source)
   separately, every action token (loss_mask 1) carries its trajectory's advantage, and those
   tokens are standardized: A~ = (A - mu_task) / (sigma_task + eps). Token-weighted, so the
   statistics come from (advantage, action-token count) pairs without expanding the tokens.
   `normalize=False` (StreamsSettings.task_adv_norm false, AgentRL's `task_adv_norm` flag off)
   leaves the GRPO advantages unchanged; the per-task statistics are still reported.

3. ERPO-style normalization (StreamsSettings.adv_norm "erpo"; ERPO as the issue describes it): within
   one batch, A_i = (R_i - mean of R over i's group) / (std of R over every trajectory of i's
   environment, its task family, in the batch + eps). The mean is per question (a group of one
   has advantage 0); the std is trajectory-weighted, of the raw rewards, `std` kind as above.
4. Positive-only (StreamsSettings.positive_only_steps): A~ = max(A, 0), the batch's final
   advantage clipped below at 0, so only better-than-baseline trajectories are reinforced.
5. Per-family scale (StreamsSettings.task_advantage_scale, rollstream's): A~ = s_task * A~, last, so
   a family's policy-gradient step is s_task times what the rules above give it (1 where not named).

Degenerate token sets (documented choice, not from the paper): a task with fewer than two action
tokens has no Bessel std (torch would return nan); we define the std of zero or one token as 0,
as the population std is. The same holds whenever all of a task's tokens carry one advantage (one
trajectory of that task in the batch, or all-equal advantages): the std is 0, every token equals
the mean, so the final advantage is exactly 0 — the task contributes no policy-gradient signal
in that batch instead of an eps-amplified one. A task with no action tokens at all has mean 0,
std 0, and final advantages 0 (they multiply no token anyway).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from streams.settings import AdvNorm, StdKind


def weighted_mean_std(values: np.ndarray, weights: np.ndarray, std: StdKind) -> tuple[float, float]:
    """Mean and std of `values` where value i occurs weights[i] times (integer counts).

    Bessel divides by (N - 1) with N = sum(weights); the std of fewer than two items is 0.
    """
    total = float(weights.sum())
    if total == 0:
        return 0.0, 0.0
    mean = float((values * weights).sum() / total)
    ddof = 1 if std == "bessel" else 0
    if total - ddof <= 0:
        return mean, 0.0
    var = float((weights * (values - mean) ** 2).sum() / (total - ddof))
    return mean, float(np.sqrt(var))


def group_reward_stats(rewards: np.ndarray, std: StdKind) -> tuple[float, float]:
    """(mean, std) GRPO uses for one group's rewards: (0, 1) for a group of one."""
    if len(rewards) == 1:
        return 0.0, 1.0
    return weighted_mean_std(rewards, np.ones_like(rewards), std)


def grpo_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[Hashable],
    std: StdKind = "bessel",
    eps: float = 1e-6,
    valid: Sequence[bool] | np.ndarray | None = None,
) -> np.ndarray:
    """Per-trajectory GRPO advantages; members with valid=False are excluded and get 0."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    keep = np.ones(len(r), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    if len(keep) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(keep)} valid flags")
    out = np.zeros(len(r), dtype=np.float64)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        if keep[i]:
            members.setdefault(g, []).append(i)
    for idx in members.values():
        mean, sd = group_reward_stats(r[idx], std)
        out[idx] = (r[idx] - mean) / (sd + eps)
    return out


@dataclass(frozen=True)
class TaskStats:
    """Token-weighted advantage statistics of one task in one batch."""

    trajectories: int
    tokens: int
    mean_before: float
    std_before: float
    mean_after: float
    std_after: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def task_normalize_counts(
    advantages: Sequence[float] | np.ndarray,
    task_ids: Sequence[Hashable],
    token_counts: Sequence[int] | np.ndarray,
    std: StdKind = "bessel",
    eps: float = 1e-6,
    normalize: bool = True,
) -> tuple[np.ndarray, dict[Hashable, TaskStats]]:
    """Task normalization from per-trajectory action-token counts (what the batcher has when
    arrays were offloaded). Returns final advantages and per-task stats, tasks in first-seen order.
    normalize=False: the final advantages are the given ones (the "after" stats equal the "before")."""
    a = np.asarray(advantages, dtype=np.float64)
    counts = np.asarray(token_counts, dtype=np.float64)
    if not len(a) == len(task_ids) == len(counts):
        raise ValueError(f"{len(a)} advantages, {len(task_ids)} task ids, {len(counts)} token counts")
    final = np.zeros(len(a), dtype=np.float64)
    stats: dict[Hashable, TaskStats] = {}
    members: dict[Hashable, list[int]] = {}
    for i, t in enumerate(task_ids):
        members.setdefault(t, []).append(i)
    for task, idx in members.items():
        w = counts[idx]
        mean, sd = weighted_mean_std(a[idx], w, std)
        # sd == 0 means every token equals the mean; dividing float rounding noise by eps
        # would turn an exact 0 into ~1e-11, so those stay 0.
        if not normalize:
            final[idx] = a[idx]
        elif sd > 0:
            final[idx] = (a[idx] - mean) / (sd + eps)
        mean_after, std_after = weighted_mean_std(final[idx], w, std)
        stats[task] = TaskStats(len(idx), int(w.sum()), mean, sd, mean_after, std_after)
    return final, stats


def task_normalize(
    advantages: Sequence[float] | np.ndarray,
    task_ids: Sequence[Hashable],
    loss_masks: Sequence[Sequence[int] | np.ndarray],
    std: StdKind = "bessel",
    eps: float = 1e-6,
    normalize: bool = True,
) -> tuple[np.ndarray, dict[Hashable, TaskStats]]:
    """Per-task token-weighted standardization over the tokens with loss_mask 1 (none: normalize=False)."""
    counts = [int(np.count_nonzero(np.asarray(m))) for m in loss_masks]
    return task_normalize_counts(advantages, task_ids, counts, std=std, eps=eps, normalize=normalize)


def erpo_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[Hashable],
    env_ids: Sequence[Hashable],
    std: StdKind = "bessel",
    eps: float = 1e-6,
) -> np.ndarray:
    """ERPO-style advantages of one batch: (R - mean of R over the group) / (std of R over the
    environment + eps). An environment whose rewards have std 0 (all equal, or one trajectory) gets
    advantages exactly 0, as task normalization treats a task of one value (module docstring)."""
    r = np.asarray(rewards, dtype=np.float64)
    if not len(r) == len(group_ids) == len(env_ids):
        raise ValueError(f"{len(r)} rewards, {len(group_ids)} group ids, {len(env_ids)} environment ids")
    centered = np.zeros(len(r), dtype=np.float64)
    for idx in _members(group_ids).values():
        centered[idx] = r[idx] - r[idx].mean()
    out = np.zeros(len(r), dtype=np.float64)
    for idx in _members(env_ids).values():
        _, sd = weighted_mean_std(r[idx], np.ones(len(idx)), std)
        if sd > 0:
            out[idx] = centered[idx] / (sd + eps)
    return out


def batch_advantages(
    group_advantages: Sequence[float] | np.ndarray,
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[Hashable],
    task_ids: Sequence[Hashable],
    token_counts: Sequence[int] | np.ndarray,
    *,
    std: StdKind = "bessel",
    eps: float = 1e-6,
    normalize: bool = True,
    adv_norm: AdvNorm = "group",
    positive_only: bool = False,
    task_scale: Mapping[Hashable, float] | None = None,
) -> tuple[np.ndarray, dict[Hashable, TaskStats]]:
    """A batch's final advantages and per-task stats: task normalization of the GRPO advantages
    (adv_norm "group"), or ERPO from the rewards, then max(A, 0) when positive_only, then each
    task's advantages times task_scale[task] (1 for a task not in it). The "before" stats describe
    the GRPO advantages, the "after" ones the final advantages, token-weighted."""
    final, stats = task_normalize_counts(group_advantages, task_ids, token_counts, std, eps, normalize)
    if adv_norm == "group" and not positive_only and not task_scale:
        return final, stats  # AgentRL's rule, untouched
    if adv_norm == "erpo":
        final = erpo_advantages(rewards, group_ids, task_ids, std, eps)
    if positive_only:
        final = np.maximum(final, 0.0)
    if task_scale:
        final = final * np.array([task_scale.get(task, 1.0) for task in task_ids], dtype=np.float64)
    counts = np.asarray(token_counts, dtype=np.float64)
    for task, idx in _members(task_ids).items():
        mean_after, std_after = weighted_mean_std(final[idx], counts[idx], std)
        before = stats[task]
        stats[task] = TaskStats(before.trajectories, before.tokens, before.mean_before, before.std_before,
                                mean_after, std_after)
    return final, stats


def _members(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Indices of each key, keys in first-seen order."""
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    return members
