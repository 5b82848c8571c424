"""The benchmarks' workload shape: step latency, turn budgets and new-token caps, log-normal, heavy-tailed,
capped, and the same for a given (trajectory, turn) every time they are drawn."""

from __future__ import annotations

import statistics

import pytest
from pydantic import ValidationError

from env_workers.settings import AgentLoopSettings
from env_workers.workload import FamilyWorkload, LogNormalCount, StepLatency, new_tokens_cap, step_delay_s, turn_budget


def test_off_by_default():
    assert not StepLatency().enabled
    assert step_delay_s(StepLatency(), "t", 0) == 0.0


def test_same_trajectory_and_turn_wait_the_same_and_others_differ():
    latency = StepLatency(median_s=1.0, sigma=1.0)
    assert step_delay_s(latency, "traj-a", 3) == step_delay_s(latency, "traj-a", 3)
    assert len({step_delay_s(latency, "traj-a", turn) for turn in range(20)}) == 20


def test_median_and_heavy_tail_match_the_log_normal():
    latency = StepLatency(median_s=0.5, sigma=1.0, max_s=1000)
    delays = sorted(step_delay_s(latency, f"t{i}", 0) for i in range(20_000))
    assert abs(statistics.median(delays) - 0.5) < 0.03
    p99 = delays[int(0.99 * len(delays))]
    assert 8.0 < p99 / 0.5 < 12.5  # exp(2.326) = 10.2
    assert statistics.mean(delays) > 1.5 * statistics.median(delays)  # the tail pulls the mean up


def test_cap_and_constant_delay():
    assert max(step_delay_s(StepLatency(median_s=1.0, sigma=3.0, max_s=2.0), f"t{i}", 0) for i in range(500)) == 2.0
    assert step_delay_s(StepLatency(median_s=0.25, sigma=0.0), "x", 1) == 0.25


def test_turn_budget_is_heavy_tailed_within_one_and_max_turns():
    count = LogNormalCount(median=4.0, sigma=0.8)
    budgets = [turn_budget(count, f"t{i}", 16) for i in range(5_000)]
    assert min(budgets) == 1 and max(budgets) == 16
    assert statistics.median(budgets) == 4
    assert statistics.mean(budgets) > 4.3  # the tail pulls the mean above the median
    assert turn_budget(count, "t7", 16) == budgets[7]  # drawn again, the same budget
    assert turn_budget(None, "t7", 16) == 16


def test_new_tokens_cap_is_drawn_per_turn_within_max_new_tokens():
    count = LogNormalCount(median=24.0, sigma=1.0)
    caps = [new_tokens_cap(count, "traj", turn, 128) for turn in range(400)]
    assert 1 <= min(caps) and max(caps) == 128
    assert len(set(caps)) > 40
    assert new_tokens_cap(count, "traj", 5, 128) == caps[5]
    assert new_tokens_cap(None, "traj", 5, 128) == 128


def test_a_family_without_its_own_latency_takes_the_loops():
    settings = AgentLoopSettings(step_latency=StepLatency(median_s=1.0),
                                 workload=[FamilyWorkload(family="calc", step_latency=StepLatency(median_s=0.2)),
                                           FamilyWorkload(family="db", turns=LogNormalCount(median=5))])
    assert settings.family_workload("calc").step_latency.median_s == 0.2
    assert settings.family_workload("db").step_latency.median_s == 1.0
    assert settings.family_workload("db").turns.median == 5
    assert settings.family_workload("kg") == FamilyWorkload(family="kg", step_latency=StepLatency(median_s=1.0))
    assert hash(settings)  # settings are frozen and hashable, shapes included


def test_a_workload_for_an_unknown_family_or_one_family_twice_is_refused():
    with pytest.raises(ValidationError, match="no family clac"):
        AgentLoopSettings(workload=[{"family": "clac", "turns": {"median": 3}}])
    with pytest.raises(ValidationError, match="family db has more than one workload shape"):
        AgentLoopSettings(workload=[{"family": "db"}, {"family": "db", "turns": {"median": 3}}])
