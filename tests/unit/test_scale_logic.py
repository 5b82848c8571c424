"""bench scale's pure part: rates over a window, efficiency per added worker, and the accounting of
every task (done, pending, lost, rolled out again with the same or another content)."""

from __future__ import annotations

import pytest

from pipeline.bench.scale_logic import account_tasks, efficiencies, scale_figures, window_rate


def test_rate_counts_events_inside_the_half_open_window():
    assert window_rate([999, 1000, 1500, 2999, 3000], 1000, 3000) == 1.5
    with pytest.raises(ValueError):
        window_rate([], 5, 5)


def test_perfect_scaling_is_one_and_a_useless_worker_zero():
    assert efficiencies([2.0, 4.0, 6.0]) == [1.0, 1.0]
    assert efficiencies([2.0, 2.0]) == [0.0]
    assert efficiencies([0.0, 1.0]) == []


def test_figures_give_speedup_parallel_efficiency_and_the_mean_gain_as_ratio():
    figures = scale_figures([2.0, 3.8, 5.0])
    assert figures["ratio"] == pytest.approx((0.9 + 0.6) / 2)
    last = figures["curve"][-1]
    assert last["workers"] == 3 and last["speedup"] == 2.5 and last["parallel_efficiency"] == pytest.approx(5 / 6)
    assert figures["curve"][0]["added_worker_efficiency"] is None
    assert scale_figures([3.0])["ratio"] is None


def _trajectory(tid: str, version: int = 0, reward: float = 0.0) -> dict:
    return {"trajectory_id": tid, "reward": reward, "turns": [{"weight_version": version}]}


def same(a: dict, b: dict) -> bool:
    return a["reward"] == b["reward"]


def test_tasks_below_the_commit_need_a_trajectory_and_the_rest_are_pending():
    tasks = [(0, 0, "a"), (0, 1, "b"), (0, 2, "c"), (1, 0, "d")]
    result = account_tasks(tasks, {0: 2}, [_trajectory("a"), _trajectory("c")], same)
    assert (result["completed"], result["lost"], result["pending"]) == (1, 1, 2)
    assert result["lost_ids"] == ["b"] and result["losses"] == 1


def test_rollouts_repeated_by_a_rebalance_are_redone_work_unless_their_content_differs():
    tasks = [(0, 0, "a"), (0, 1, "b")]
    copies = [_trajectory("a"), _trajectory("a"), _trajectory("b"), _trajectory("b", version=1, reward=1.0)]
    result = account_tasks(tasks, {0: 2}, copies, same)
    assert result["rolled_out_again"] == 2 and result["copies_that_differ"] == 0 and result["losses"] == 0
    result = account_tasks(tasks, {0: 2}, [*copies, _trajectory("a", reward=1.0)], same)
    assert result["copies_that_differ"] == 1 and result["losses"] == 1
