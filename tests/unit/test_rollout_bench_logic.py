"""`rollstream bench rollout`'s pure part (pipeline/bench/rollout_logic.py)."""

from __future__ import annotations

import pytest

from env_workers.engines import turn_seed
from pipeline.bench.rollout_logic import (
    caught_up,
    chains,
    cpu_phase,
    engine_phase,
    loop_seconds,
    metric_totals,
    status_counts,
    task_count,
    time_per_turn,
    transfer,
    turn_requests,
)
from schemas import arrays


def _trajectory(tid: str, ids: list[int], turns: list[tuple[int, int]], started_at_ms: int = 0,
                status: str = "completed") -> dict:
    return {"trajectory_id": tid, "input_ids": arrays.pack_ids(ids), "started_at_ms": started_at_ms, "status": status,
            "turns": [{"start": start, "length": length} for start, length in turns]}


def test_engine_alone_repeats_every_turn_with_its_prompt_length_count_and_the_workers_seed():
    t = _trajectory("t-1", [5, 6, 7, 8, 9, 10, 11, 12], [(3, 2), (6, 2)])
    requests = turn_requests([t], replacement=1, seeded=True)
    assert [(r.prompt, r.count) for r in requests] == [([1, 6, 7], 2), ([1, 6, 7, 8, 9, 10], 2)]
    assert [r.seed for r in requests] == [turn_seed("t-1", 3), turn_seed("t-1", 6)]
    assert [r.seed for r in turn_requests([t], replacement=1, seeded=False)] == [None, None]


def test_engine_alone_prompt_never_starts_with_the_loops_first_token():
    t = _trajectory("t-1", [1, 6, 7, 8], [(3, 1)])
    assert turn_requests([t], replacement=1, seeded=False)[0].prompt == [2, 6, 7]


def test_loop_window_runs_from_the_first_rollout_start_to_the_acknowledgement():
    done = [_trajectory("a", [1, 2], [], started_at_ms=10_500), _trajectory("b", [1, 2], [], started_at_ms=10_000)]
    assert loop_seconds(done, acknowledged_at_s=12.25) == pytest.approx(2.25)


def test_group_is_caught_up_only_when_committed_past_every_nonempty_partition():
    end = {0: 5, 1: 0, 2: 3}
    assert caught_up(end, {0: 5, 2: 3})
    assert not caught_up(end, {0: 5, 2: 2})
    assert not caught_up(end, {0: 5})  # partition 2 not read yet
    assert caught_up({0: 0, 1: 0}, {})  # an empty topic has nothing to pass over


def test_transfer_gives_mb_per_s_and_keeps_extra_figures():
    row = transfer(3 * 1024 * 1024, 1.5, version=2)
    assert row == {"bytes": 3 * 1024 * 1024, "seconds": 1.5, "mb_per_s": 2.0, "version": 2}


def test_status_counts_count_trajectories_per_final_status():
    done = [_trajectory(str(i), [1], [], status=s) for i, s in enumerate(["completed", "task_error", "completed"])]
    assert status_counts(done) == {"completed": 2, "task_error": 1}


def test_chained_replay_starts_each_trajectory_from_its_first_prompt_with_the_environments_tokens_between_turns():
    # ids: prompt [5, 6], turn 0 generates [7, 8], the environment appends [9], turn 1 generates [10]
    late = _trajectory("late", [5, 6, 7, 8, 9, 10], [(2, 2), (5, 1)], started_at_ms=20)
    early = _trajectory("early", [5, 11, 12], [(2, 1)], started_at_ms=10)
    replay = chains([late, early], replacement=1, seeded=True)
    assert [c.trajectory_id for c in replay] == ["early", "late"]  # phase 1's start order
    assert (replay[1].prompt, replay[1].counts, replay[1].following) == ([1, 6], [2, 1], [[9], []])
    assert replay[1].seeds == [turn_seed("late", 2), turn_seed("late", 5)]  # the worker's, by prompt length
    assert chains([late], replacement=5, seeded=False)[0].prompt == [6, 6]  # never the loop's first token
    assert chains([late], replacement=1, seeded=False)[0].seeds == [None, None]


EXPOSITION = """# HELP vllm:iteration_tokens_total Tokens per engine step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 10.0
vllm:iteration_tokens_total_count{engine="0"} 10.0
vllm:iteration_tokens_total_sum{engine="0"} 70.0
# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="a"} 100.0
vllm:prompt_tokens_total{engine="1",model_name="a"} 50.0
"""


def test_metric_totals_sum_each_sample_over_its_labels_and_leave_histogram_buckets_out():
    totals = metric_totals(EXPOSITION)
    assert totals["vllm:prompt_tokens_total"] == 150.0
    assert totals["vllm:iteration_tokens_total_count"] == 10.0
    assert not any(name.endswith("_bucket") for name in totals)


def test_engine_phase_gives_steps_ms_per_step_requests_inside_and_prompt_tokens_computed():
    before = {"vllm:iteration_tokens_total_count": 100.0, "vllm:request_inference_time_seconds_sum": 5.0,
              "vllm:prompt_tokens_total": 1000.0, "vllm:prompt_tokens_cached_total": 800.0}
    after = {"vllm:iteration_tokens_total_count": 600.0, "vllm:request_inference_time_seconds_sum": 45.0,
             "vllm:prompt_tokens_total": 3000.0, "vllm:prompt_tokens_cached_total": 2500.0}
    assert engine_phase(before, after, seconds=10.0) == {
        "steps": 500.0, "ms_per_step": 20.0, "mean_requests_inside": 4.0, "prompt_tokens_computed": 300.0}


def test_engine_phase_says_none_for_a_counter_the_engine_does_not_export():
    assert engine_phase({}, {}, seconds=10.0) == {
        "steps": None, "ms_per_step": None, "mean_requests_inside": None, "prompt_tokens_computed": None}


def test_cpu_phase_gives_each_partys_seconds_per_token_and_the_machines_busy_share():
    before = {"loop": 1.0, "loop_thread_wait": 0.5, "engine": 10.0, "broker": None, "machine": 100.0}
    after = {"loop": 3.0, "loop_thread_wait": 1.5, "engine": 50.0, "broker": None, "machine": 136.0}
    row = cpu_phase(before, after, seconds=20.0, tokens=10_000, cores=2)
    assert row["loop_cpu_s"] == 2.0 and row["engine_cpu_s"] == 40.0 and row["loop_thread_wait_s"] == 1.0
    assert row["loop_ms_per_token"] == pytest.approx(0.2) and row["engine_ms_per_token"] == pytest.approx(4.0)
    assert row["broker_cpu_s"] is None and row["broker_ms_per_token"] is None  # no local broker
    assert row["machine_busy_share"] == pytest.approx(0.9)


def test_time_per_turn_splits_each_turn_into_engine_call_environment_and_the_rest_of_the_loop():
    t = {"started_at_ms": 1_000, "finished_at_ms": 2_100,
         "turns": [{"generate_ms": 400.0, "env_ms": 50.0}, {"generate_ms": 500.0, "env_ms": 50.0}]}
    assert time_per_turn([t]) == {"generate_ms": 450.0, "environment_ms": 50.0, "loop_ms": 50.0}
    assert time_per_turn([]) == {"generate_ms": 0.0, "environment_ms": 0.0, "loop_ms": 0.0}


def test_phase_1_takes_four_tasks_per_loop_by_default_within_the_mixs_distinct_tasks():
    assert task_count(None, concurrency=16, split_sizes=[200, 60]) == 64
    assert task_count(None, concurrency=32, split_sizes=[200, 60]) == 120  # two splits of at least 60
    assert task_count(10, concurrency=32, split_sizes=[200, 60]) == 10
    with pytest.raises(ValueError, match=r"^--trajectories 121 is more than the 120 distinct tasks of the mix"):
        task_count(121, concurrency=4, split_sizes=[200, 60])
