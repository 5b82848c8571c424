"""Evaluation statistics of trajectories: success, intervals, the paper's Table 3 and Table 7.

Pure functions of `trajectory` events (schemas/avro/trajectory.avsc) as plain dicts; no I/O.
Used by the run report (pipeline/analysis/report.py) and by `rollstream eval`.

- Success is one rule everywhere (`is_success`): the session completed with full credit.
- Intervals are Wilson score intervals (Wilson 1927): unlike the normal approximation they stay
  inside [0, 1] and are not degenerate at 0/n or n/n, which small evaluation sets often hit.
- Table 3 of AgentRL reports success as mean ± std over the n repeats of each sample; a repeat is
  the trajectory's `member` index within its group.
- Table 7 reports the share of each final session status.
- Before/after compares the first and the last validation round of each task. Both rounds evaluate
  the same held-out samples (the first `val_samples` of the split), so the comparison is paired: per
  sample, the change of its success share (successes / repeats); the verdict asks whether the 95%
  interval of the mean change excludes zero and the paired sign-flip test agrees (p < 0.05). The
  interval is the normal approximation of the mean, which overclaims when few samples changed (five
  samples up and none down of a hundred give an interval above zero; their signs alone are a coin
  tossed five times, p = 2/32); the sign-flip test (Fisher's randomization test for paired data) is
  exact whatever the number of samples that changed. Pairing is the right analysis and the more powerful one:
  the n repeats of a sample are not independent episodes (a sample the policy cannot solve fails in
  all of them), which the per-round Wilson intervals ignore, and a sample's difficulty cancels out of
  its own change. With fewer than MIN_PAIRED_SAMPLES paired samples (the normal approximation of the
  mean is not to be trusted) the verdict falls back to "the two 95% Wilson intervals are disjoint".
  The two-proportion z-test p-value of the episodes is reported beside either.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from pipeline.policy.demonstrations import FULL_CREDIT
from schemas.ids import group_id

# z of a two-sided 95% interval, the value the report states
Z95 = 1.959964
# Validation round r is dispatched with epoch = r (pipeline/dispatcher_logic.plan_validation), so a
# group's round is the epoch whose group id matches; rounds are searched up to this bound.
MAX_ROUND = 10_000
# Fewer paired samples than this: the verdict uses the disjoint-interval rule (see the module docstring).
MIN_PAIRED_SAMPLES = 30
# Above this many (samples x possible sums) the sign-flip test uses its normal approximation instead of the
# exact count (a second or so of counting): many samples of varying repeat counts, e.g. 1,000 samples whose
# repeats range 1-8 (common denominator 840). 200 samples x 4 repeats take 320,000.
EXACT_SIGN_FLIP_WORK = 5_000_000
VERDICT_CRITERION = ("improved / worse: the 95% interval of the change in success, paired per held-out sample "
                     "between the first and the last validation round (mean over samples of the change of the "
                     "sample's success share), lies above / below zero and the paired sign-flip test of that "
                     f"change gives p < 0.05; with fewer than {MIN_PAIRED_SAMPLES} "
                     "samples in both rounds, the rounds' 95% Wilson intervals are disjoint instead; otherwise "
                     "no clear change (two-proportion z-test p-value of the episodes shown beside)")

Trajectory = Mapping[str, Any]


def is_success(traj: Trajectory) -> bool:
    """Completed with full credit: the one definition of success in rollstream's reports."""
    return traj["status"] == "completed" and traj["env_reward"] >= FULL_CREDIT


def dedup(trajs: Iterable[Trajectory]) -> list[Trajectory]:
    """First occurrence of each trajectory_id: delivery is at-least-once, so a topic can hold a
    re-rollout of the same member twice, and counting both would inflate the episode count."""
    seen: set[str] = set()
    out = []
    for t in trajs:
        if t["trajectory_id"] not in seen:
            seen.add(t["trajectory_id"])
            out.append(t)
    return out


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return Z95 if confidence == 0.95 else statistics.NormalDist().inv_cdf((1.0 + confidence) / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n is 0 (nothing is known)."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = successes / n
    denominator = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    # clamp rounding at the ends (0/n, n/n) so the interval always contains the estimate
    return max(0.0, min(center - half, p)), min(1.0, max(center + half, p))


def two_proportion_p_value(s1: int, n1: int, s2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test; 1.0 when it is undefined (an empty
    side, or both sides all successes or all failures, where no difference is seen)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (s1 + s2) / (n1 + n2)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2))
    if se == 0.0:
        return 1.0
    z = (s2 / n2 - s1 / n1) / se
    return math.erfc(abs(z) / math.sqrt(2.0))


def _by_task(trajs: Iterable[Trajectory]) -> dict[str, list[Trajectory]]:
    out: dict[str, list[Trajectory]] = {}
    for t in trajs:
        out.setdefault(t["task"], []).append(t)
    return dict(sorted(out.items()))


def proportion(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Episodes, successes, success rate and its 95% Wilson interval."""
    successes = sum(is_success(t) for t in trajs)
    lo, hi = wilson_interval(successes, len(trajs))
    return {"episodes": len(trajs), "successes": successes,
            "rate": successes / len(trajs) if trajs else 0.0, "ci95": [lo, hi]}


def success_by_task(trajs: Iterable[Trajectory]) -> dict[str, dict[str, Any]]:
    """Per task: episodes, successes, success_rate, ci95 [lo, hi] and mean_reward (training reward)."""
    out = {}
    for task, mine in _by_task(trajs).items():
        p = proportion(mine)
        out[task] = {"episodes": p["episodes"], "successes": p["successes"], "success_rate": p["rate"],
                     "ci95": p["ci95"], "mean_reward": statistics.fmean(t["reward"] for t in mine)}
    return out


def repeat_table(trajs: Iterable[Trajectory]) -> dict[str, dict[str, Any]]:
    """Paper Table 3: per task, the success rate of each repeat (member index k over all samples)
    and mean ± std over the repeats (sample std, ddof 1; 0 with a single repeat)."""
    out = {}
    for task, mine in _by_task(trajs).items():
        by_member: dict[int, list[Trajectory]] = {}
        for t in mine:
            by_member.setdefault(t["member"], []).append(t)
        members = sorted(by_member)
        rates = [sum(is_success(t) for t in by_member[m]) / len(by_member[m]) for m in members]
        out[task] = {"repeats": len(rates), "members": members, "rates": rates,
                     "episodes": [len(by_member[m]) for m in members],
                     "mean": statistics.fmean(rates), "std": statistics.stdev(rates) if len(rates) > 1 else 0.0}
    return out


def _shares(trajs: Sequence[Trajectory]) -> dict[str, float]:
    counts: dict[str, int] = {}
    for t in trajs:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    return {status: c / len(trajs) for status, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}


def termination_shares(trajs: Iterable[Trajectory]) -> dict[str, Any]:
    """Paper Table 7: {"tasks": {task: {"episodes", "shares": {status: share}}}, "overall": same};
    each shares dict sums to 1 and names only statuses that occurred."""
    trajs = list(trajs)
    return {"tasks": {task: {"episodes": len(mine), "shares": _shares(mine)} for task, mine in _by_task(trajs).items()},
            "overall": {"episodes": len(trajs), "shares": _shares(trajs)}}


def validation_rounds(val_trajs: Iterable[Trajectory], known: Mapping[str, int] | None = None,
                      max_round: int = MAX_ROUND) -> dict[str, int]:
    """group_id -> validation round. `known` (from task_requested events: group_id -> epoch) wins;
    otherwise the round is the epoch that reproduces the group id. Groups found by neither are
    left out, so the caller can report them."""
    rounds: dict[str, int] = {}
    for t in val_trajs:
        gid = t["group_id"]
        if gid in rounds:
            continue
        if known is not None and gid in known:
            rounds[gid] = known[gid]
            continue
        for epoch in range(max_round + 1):
            if group_id(t["run"], t["task"], t["split"], t["sample_index"], epoch) == gid:
                rounds[gid] = epoch
                break
    return rounds


def paired_change(before: Sequence[Trajectory], after: Sequence[Trajectory],
                  confidence: float = 0.95) -> dict[str, Any] | None:
    """The change of success between two rounds, paired per sample ((split, sample_index)) evaluated in both:
    {"samples", "mean", "ci95": [lo, hi], "up", "down"}; mean = the mean over samples of (after share - before
    share), a share being successes / episodes of that sample in that round; the interval is the normal
    approximation of that mean (sample std, ddof 1); up / down count the samples that rose / fell;
    p_sign_flip is the exact paired sign-flip test's two-sided p-value (sign_flip_p_value).
    None with fewer than two paired samples (no spread to measure)."""
    def shares(trajs: Sequence[Trajectory]) -> dict[tuple[str, int], Fraction]:
        counts: dict[tuple[str, int], list[int]] = {}
        for t in trajs:
            c = counts.setdefault((t["split"], t["sample_index"]), [0, 0])
            c[0] += is_success(t)
            c[1] += 1
        return {key: Fraction(wins, n) for key, (wins, n) in counts.items()}

    b, a = shares(before), shares(after)
    exact = [a[key] - b[key] for key in sorted(b.keys() & a.keys())]
    if len(exact) < 2:
        return None
    changes = [float(c) for c in exact]
    mean = statistics.fmean(changes)
    half = _z(confidence) * statistics.stdev(changes) / math.sqrt(len(changes))
    return {"samples": len(changes), "mean": mean, "ci95": [mean - half, mean + half],
            "up": sum(c > 0 for c in changes), "down": sum(c < 0 for c in changes),
            "p_sign_flip": sign_flip_p_value(exact)}


def sign_flip_p_value(changes: Sequence[Fraction]) -> float:
    """Two-sided p-value of the paired sign-flip (randomization) test that the mean change is zero (Fisher
    1935): with no change, each sample's change was as likely to come out with the other sign, so p is the
    share of the 2^n sign assignments whose sum is at least as far from zero as the one observed. Exact:
    the changes are fractions (differences of success shares), so the sums are counted over the integers
    of their common denominator (beyond EXACT_SIGN_FLIP_WORK, the normal approximation of that count).
    Samples that did not change have no sign and count for nothing."""
    nonzero = [c for c in changes if c != 0]
    if not nonzero:
        return 1.0
    denominator = math.lcm(*(c.denominator for c in nonzero))
    steps = [abs(c.numerator) * (denominator // c.denominator) for c in nonzero]
    observed = abs(sum(c.numerator * (denominator // c.denominator) for c in nonzero))
    if len(steps) * (2 * sum(steps) + 1) > EXACT_SIGN_FLIP_WORK:
        # Many samples changed (only then is the count this large): the same distribution's normal
        # approximation (mean 0, variance the sum of the squared changes) is as good as exact there, with the
        # continuity correction: the sums lie 2 x gcd(steps) apart, so |sum| >= observed begins half that
        # below it (without it the approximation's p comes out too small, claiming changes the count would not).
        corrected = max(observed - math.gcd(*steps), 0)
        return math.erfc(corrected / math.sqrt(2 * sum(step * step for step in steps)))
    sums = Counter({0: 1})
    for step in steps:  # the distribution of the signed sum, one sample at a time
        grown: Counter[int] = Counter()
        for total, ways in sums.items():
            grown[total + step] += ways
            grown[total - step] += ways
        sums = grown
    return sum(ways for total, ways in sums.items() if abs(total) >= observed) / 2 ** len(steps)


def paired_decision(change: Mapping[str, Any], alpha: float = 0.05) -> str | None:
    """"improved" / "worse" when the paired change's interval lies above / below zero and its sign-flip test
    agrees (p < alpha; a change recorded before the test existed is judged by its interval alone); else None."""
    lo, hi = change["ci95"]
    p = change.get("p_sign_flip")
    agrees = p is None or p < alpha
    if lo > 0 and agrees:
        return "improved"
    if hi < 0 and agrees:
        return "worse"
    return None


def _pairs_decide(change: Mapping[str, Any] | None) -> bool:
    return change is not None and change["samples"] >= MIN_PAIRED_SAMPLES


def _interval_gap(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[float, float]:
    """(after's low - before's high, after's high - before's low): positive low or negative high = disjoint."""
    (b_lo, b_hi), (a_lo, a_hi) = before["ci95"], after["ci95"]
    return a_lo - b_hi, a_hi - b_lo


def verdict(before: Mapping[str, Any], after: Mapping[str, Any] | None,
            change: Mapping[str, Any] | None = None) -> str:
    """improved / worse when the paired change's 95% interval excludes zero and its sign-flip test agrees
    (at least MIN_PAIRED_SAMPLES samples), else when the two rounds' 95% intervals are disjoint; otherwise
    no clear change."""
    if after is None:
        return "not evaluated after training"
    if _pairs_decide(change):
        return paired_decision(change) or "no clear change"
    lo, hi = _interval_gap(before, after)
    if lo > 0:
        return "improved"
    if hi < 0:
        return "worse"
    return "no clear change"


def before_after(val_trajs: Iterable[Trajectory], rounds: Mapping[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per task, the first vs the last validation round: {"before": {round, episodes, successes,
    rate, ci95}, "after": same or None (a single round), "change": paired_change or None,
    "criterion": "paired change" | "disjoint intervals" | None, "intervals_disjoint", "p_value",
    "verdict"}. `rounds` maps group_id -> round (see validation_rounds); trajectories of unmapped
    groups are not counted."""
    val_trajs = [t for t in val_trajs if t.get("validation", False)]
    if rounds is None:
        rounds = validation_rounds(val_trajs)
    out = {}
    for task, mine in _by_task(t for t in val_trajs if t["group_id"] in rounds).items():
        by_round: dict[int, list[Trajectory]] = {}
        for t in mine:
            by_round.setdefault(rounds[t["group_id"]], []).append(t)
        first, last = min(by_round), max(by_round)
        before = {"round": first} | proportion(by_round[first])
        after = {"round": last} | proportion(by_round[last]) if last != first else None
        change = paired_change(by_round[first], by_round[last]) if after else None
        gap = _interval_gap(before, after) if after else (0.0, 0.0)
        out[task] = {
            "before": before, "after": after, "change": change,
            "criterion": None if after is None else "paired change" if _pairs_decide(change) else "disjoint intervals",
            "intervals_disjoint": gap[0] > 0 or gap[1] < 0,
            "p_value": two_proportion_p_value(before["successes"], before["episodes"],
                                              after["successes"], after["episodes"]) if after else None,
            "verdict": verdict(before, after, change),
        }
    return out
