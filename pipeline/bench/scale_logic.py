"""`rollstream bench scale`, the pure part: throughput per worker count, efficiency per added worker,
and the accounting of every task (trained once, pending, lost, rolled out again).

Efficiency of the k-th worker = (rate with k workers - rate with k-1) / rate with one: 1.0 is
perfect scaling, 0 is a worker that added nothing. The benchmark's `ratio` is their mean over the
added workers. Task accounting, from the topics alone: a task below its partition's committed
offset must have a trajectory (else it is lost); a task at or past it is pending (the group resumes
there); a trajectory id published more than once was rolled out again (a rebalance moved the task
before its offset was committed) and counts as work redone, not as a loss, as long as every copy
carries the same content on the same weights (the aggregator keeps the first; training sees one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def window_rate(timestamps_ms: Iterable[int], start_ms: int, end_ms: int) -> float:
    """Events per second with a timestamp in [start_ms, end_ms)."""
    if end_ms <= start_ms:
        raise ValueError("empty measurement window")
    return sum(1 for t in timestamps_ms if start_ms <= t < end_ms) * 1000.0 / (end_ms - start_ms)


def efficiencies(rates: Sequence[float]) -> list[float]:
    """Per added worker (the 2nd, 3rd, ...): its throughput gain as a share of one worker's rate."""
    if not rates or rates[0] <= 0:
        return []
    return [(rates[k] - rates[k - 1]) / rates[0] for k in range(1, len(rates))]


def scale_figures(rates: Sequence[float]) -> dict[str, Any]:
    """The curve and its summary: per worker count the rate, speed-up and parallel efficiency."""
    gains = efficiencies(rates)
    rows = [{"workers": k + 1, "trajectories_per_s": rate,
             "speedup": rate / rates[0] if rates[0] > 0 else None,
             "parallel_efficiency": rate / ((k + 1) * rates[0]) if rates[0] > 0 else None,
             "added_worker_efficiency": gains[k - 1] if k >= 1 else None}
            for k, rate in enumerate(rates)]
    return {"ratio": sum(gains) / len(gains) if gains else None, "curve": rows}


def account_tasks(tasks: Iterable[tuple[int, int, str]], committed: Mapping[int, int],
                  trajectories: Iterable[Mapping[str, Any]],
                  same: Callable[[Mapping[str, Any], Mapping[str, Any]], bool]) -> dict[str, Any]:
    """`tasks`: (partition, offset, trajectory id) of every task published; `committed`: the group's
    committed offset per partition; `trajectories`: the trajectory events; `same(a, b)`: whether two
    copies agree on what training reads. Losses = tasks lost + copies that disagree."""
    copies: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for t in trajectories:
        copies[t["trajectory_id"]].append(t)
    done = lost = pending = 0
    lost_ids = []
    for partition, offset, tid in tasks:
        if offset < committed.get(partition, 0):
            if tid in copies:
                done += 1
            else:
                lost += 1
                lost_ids.append(tid)
        else:
            pending += 1
    rerolled = sum(len(c) - 1 for c in copies.values())
    differing = sum(1 for c in copies.values() for other in c[1:]
                    if other["turns"] and c[0]["turns"]
                    and [u["weight_version"] for u in other["turns"]] == [u["weight_version"] for u in c[0]["turns"]]
                    and not same(c[0], other))
    return {"tasks": done + lost + pending, "completed": done, "pending": pending, "lost": lost,
            "lost_ids": lost_ids[:10], "rolled_out_again": rerolled, "copies_that_differ": differing,
            "losses": lost + differing}
