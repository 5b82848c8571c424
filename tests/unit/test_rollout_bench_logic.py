"""`rollstream bench rollout`'s pure part (pipeline/bench/rollout_logic.py)."""

from __future__ import annotations

import pytest

from env_workers.engines import turn_seed
from pipeline.bench.rollout_logic import caught_up, loop_seconds, status_counts, transfer, turn_requests
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
