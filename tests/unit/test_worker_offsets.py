"""The env worker's commit rule: a partition's offset moves only past a contiguous run of tasks
whose trajectories the broker acknowledged."""

from __future__ import annotations

from env_workers.worker import Watermarks

P0, P1 = ("tasks", 0), ("tasks", 1)


def test_nothing_is_committable_until_the_first_task_is_done():
    marks = Watermarks()
    for offset in (5, 6, 7):
        marks.track(P0, offset)
    marks.done(P0, 6)
    marks.done(P0, 7)
    assert marks.committable() == {}


def test_watermark_moves_past_the_contiguous_done_run_only():
    marks = Watermarks()
    for offset in (5, 6, 7, 8):
        marks.track(P0, offset)
    for offset in (5, 6, 8):
        marks.done(P0, offset)
    assert marks.committable() == {P0: 7}
    marks.committed(P0, 7)
    assert marks.pending() == 2
    marks.done(P0, 7)
    assert marks.committable() == {P0: 9}


def test_partitions_advance_independently():
    marks = Watermarks()
    marks.track(P0, 0)
    marks.track(P1, 10)
    marks.track(P1, 11)
    marks.done(P1, 10)
    assert marks.committable() == {P1: 11}


def test_offsets_skipped_by_the_consumer_do_not_hold_the_watermark():
    # Offset 3 went to the dead-letter topic inside the consumer and was never tracked.
    marks = Watermarks()
    marks.track(P0, 2)
    marks.track(P0, 4)
    marks.done(P0, 2)
    marks.done(P0, 4)
    assert marks.committable() == {P0: 5}


def test_completion_arriving_out_of_order_commits_once_the_gap_closes():
    marks = Watermarks()
    for offset in range(4):
        marks.track(P0, offset)
    for offset in (3, 1, 2):
        marks.done(P0, offset)
        assert marks.committable() == {}
    marks.done(P0, 0)
    assert marks.committable() == {P0: 4}


def test_revoked_partition_is_forgotten_and_late_acks_are_ignored():
    marks = Watermarks()
    marks.track(P0, 0)
    marks.track(P1, 0)
    marks.forget([P0])
    marks.done(P0, 0)  # a trajectory acknowledged after its partition moved to another worker
    assert marks.committable() == {}
    assert marks.pending() == 1


def test_committed_run_is_not_offered_again():
    marks = Watermarks()
    marks.track(P0, 0)
    marks.done(P0, 0)
    marks.committed(P0, 1)
    assert marks.committable() == {}
    assert marks.pending() == 0
