"""The benchmarks' environment step latency: log-normal, heavy-tailed, capped, and the same for a
given (trajectory, turn) every time it is drawn."""

from __future__ import annotations

import statistics

from env_workers.latency import StepLatency, step_delay_s


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
