"""bench faults' pure part: the schedule (one fault at a time, recovery by learner progress and dead
letters), work redone per fault window, and the table whose total of losses must be zero."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pipeline.bench.faults_logic import (KILLS, SCALED_DOWN, FaultRecord, FaultSchedule, dead_letter_positions,
                                         fault_table, redone, restarts_per_fault)
from schemas import topics


def test_first_fault_waits_for_the_start_version_then_one_at_a_time():
    s = FaultSchedule(["learner_kill", "streams_kill"], start_version=2)
    assert s.due(1) is None
    assert s.due(2) == "learner_kill"
    s.injected("learner_kill", 2, 1_000)
    assert s.due(5) is None  # the first is not recovered yet
    s.observe(2, 2_000)
    assert s.current is not None
    s.observe(3, 3_000, component_back=False)  # training went on without the killed process: not yet
    assert s.current is not None
    s.observe(3, 4_500)
    assert s.current is None and s.records[0].recovery_s == 3.5
    assert s.due(3) == "streams_kill" and not s.done
    s.injected("streams_kill", 3, 5_000)
    s.observe(4, 6_000)
    assert s.done


def test_poison_recovers_only_when_every_event_is_a_dead_letter():
    s = FaultSchedule(["poison_events"])
    poison = [(topics.TASKS, 0, 7), (topics.BATCHES, 1, 3)]
    s.injected("poison_events", 1, 0, poison=poison)
    s.observe(5, 1_000, {(topics.TASKS, 0, 7)})
    assert s.current is not None and s.current.poison_found == 1
    s.observe(5, 2_000, {(topics.TASKS, 0, 7), (topics.BATCHES, 1, 3), (topics.TASKS, 0, 8)})
    assert s.done and s.records[0].poison_found == 2


def test_unknown_or_missing_faults_are_refused_and_out_of_turn_injection_too():
    with pytest.raises(ValueError, match="unknown faults"):
        FaultSchedule(["cosmic_ray"])
    with pytest.raises(ValueError, match="no fault"):
        FaultSchedule([])
    s = FaultSchedule(["learner_kill", "streams_kill"])
    with pytest.raises(ValueError, match="not due"):
        s.injected("streams_kill", 1, 0)


def test_versions_needed_leaves_room_for_slow_recoveries():
    assert FaultSchedule(["learner_kill", "streams_kill", "poison_events"], start_version=1).versions_needed() == 8


@dataclass
class Rec:
    timestamp_ms: int
    value: dict[str, Any]


def test_ids_published_again_count_in_the_window_of_the_fault_they_follow():
    faults = [FaultRecord("env_worker_kill", 100, 1), FaultRecord("learner_kill", 200, 2)]
    records = {
        topics.TRAJECTORIES: [Rec(50, {"trajectory_id": "a"}), Rec(150, {"trajectory_id": "a"}),
                              Rec(160, {"trajectory_id": "b"}), Rec(250, {"trajectory_id": "b"})],
        topics.WEIGHTS: [Rec(10, {"version": 0, "batch_id": None}), Rec(20, {"version": 0, "batch_id": None}),
                         Rec(210, {"version": 2, "batch_id": "x"}), Rec(220, {"version": 2, "batch_id": "x"})],
    }
    assert redone(records, faults) == [{topics.TRAJECTORIES: 1, topics.WEIGHTS: 0},
                                       {topics.TRAJECTORIES: 1, topics.WEIGHTS: 1}]


def test_dead_letters_without_a_reason_do_not_count():
    letters = [{"source_topic": "tasks", "source_partition": 0, "source_offset": 1, "reason": "bad magic"},
               {"source_topic": "tasks", "source_partition": 0, "source_offset": 2, "reason": ""}]
    assert dead_letter_positions(letters) == {("tasks", 0, 1)}


def test_losses_add_unrecovered_faults_missing_dead_letters_and_verify_mismatches():
    recovered = FaultRecord("learner_kill", 0, 1, recovered_at_ms=9_000)
    stuck = FaultRecord("streams_kill", 10_000, 2)
    poison = FaultRecord("poison_events", 20_000, 3, recovered_at_ms=21_000,
                         poison=[("tasks", 0, 1), ("batches", 0, 2)], poison_found=1)
    report = {"checks": [{"name": "groups_reach_batches", "mismatches": [{}, {}]},
                         {"name": "grpo_advantages", "mismatches": []}], "not_checked": {}, "pending_groups": []}
    table = fault_table([recovered, stuck, poison], [{}, {}, {}], report)
    assert [r["losses"] for r in table["faults"]] == [0, 1, 1]
    assert table["verify"]["loss_checks"]["groups_reach_batches"] == 2
    assert table["ratio"] == table["losses"] == 4
    clean = fault_table([recovered], [{topics.TRAJECTORIES: 3}], {"checks": [], "not_checked": {}})
    assert clean["ratio"] == 0 and clean["faults"][0]["recovery_s"] == 9.0 and clean["verify"]["ok"]


def test_restarts_are_counted_in_the_window_of_the_fault_that_caused_them():
    kafka = FaultRecord("kafka_restart", 0, 1, restarts_before={"learner": 1})
    minio = FaultRecord("minio_restart", 10, 2, restarts_before={"learner": 2, "engine-a": 0})
    final = {"learner": 2, "engine-a": 1, "streams": 1}
    assert restarts_per_fault([kafka, minio], final) == [{"learner": 1}, {"engine-a": 1, "streams": 1}]


def test_a_process_restarted_during_a_broker_restart_is_a_finding_that_fails_the_run():
    s = FaultSchedule(["kafka_restart"])
    kafka = s.injected("kafka_restart", 1, 0, restarts={"learner": 0, "streams": 0})
    s.observe(2, 30_000)
    assert kafka.recovered_at_ms is not None and kafka.killed is None  # it recovered, by crashing
    table = fault_table([kafka], [{}], {"checks": [], "not_checked": {}}, {"learner": 1, "streams": 0})
    row = table["faults"][0]
    assert row["restarted"] == {"learner": 1} and row["losses"] == 0
    assert row["findings"] == ["learner exited during kafka_restart and was restarted: it should ride through it"]
    assert table["losses"] == 0 and table["findings"] == 1 and table["ratio"] == 1 and not table["ok"]


def test_the_process_a_fault_kills_may_restart_once_and_nothing_else_may():
    s = FaultSchedule(["learner_kill", "engine_kill", "minio_restart"])
    learner = s.injected("learner_kill", 1, 0, restarts={})
    s.observe(2, 1_000)
    engine = s.injected("engine_kill", 2, 2_000, restarts={"learner": 1}, killed="engine-7")
    s.observe(3, 3_000)
    minio = s.injected("minio_restart", 3, 4_000, restarts={"learner": 1, "engine-7": 1})
    s.observe(4, 5_000)
    assert (learner.killed, engine.killed, minio.killed) == ("learner", "engine-7", None)
    clean = fault_table([learner, engine, minio], [{}, {}, {}], {"checks": []}, {"learner": 1, "engine-7": 1})
    assert [r["findings"] for r in clean["faults"]] == [[], [], []] and clean["ok"] and clean["ratio"] == 0
    # the engine kill also brought the learner down, and the learner crashed again after its own kill
    s2 = FaultSchedule(["learner_kill", "engine_kill"])
    learner = s2.injected("learner_kill", 1, 0, restarts={})
    s2.observe(2, 1_000)
    engine = s2.injected("engine_kill", 2, 2_000, restarts={"learner": 2}, killed="engine-7")
    s2.observe(3, 3_000)
    table = fault_table([learner, engine], [{}, {}], {"checks": []}, {"learner": 3, "engine-7": 1})
    assert [len(r["findings"]) for r in table["faults"]] == [1, 1]
    assert "again after its own kill" in table["faults"][0]["findings"][0]
    assert table["faults"][1]["findings"] == ["learner exited during engine_kill and was restarted: "
                                              "it should ride through it"]
    assert table["ratio"] == 2 and not table["ok"]


def test_only_process_kills_kill_anything_on_purpose():
    assert set(KILLS) == {"env_worker_kill", "streams_kill", "learner_kill", "engine_kill"}
    assert not {"kafka_restart", "minio_restart", "poison_events"} & set(KILLS)
    assert "kafka_restart" in SCALED_DOWN  # the scaled-down run checks every client rides through a broker restart
