"""Dispatcher planning: interleave order, group ids, in-flight bound, restart cursor, validation."""

import pytest

from pipeline.dispatch import logic
from pipeline.dispatch.logic import (
    Cursor, DispatcherSettings, Slot, TaskSource, cursor_from_dispatched, dispatch_budget, group_id, in_flight,
    next_slots, plan_training, plan_validation, position_of, slot_at, validation_round_due,
)
from schemas.codec import codec, encode

SOURCES = (TaskSource(task="os", split="train", count=2), TaskSource(task="db", split="train", count=3),
           TaskSource(task="kg", split="train", count=1))
SETTINGS = DispatcherSettings(sources=SOURCES, validation_sources=(TaskSource(task="os", split="dev", count=2),),
                              group_size=3, batch_size=2)


def names(slots):
    return [(s.task, s.sample_index, s.epoch) for s in slots]


def test_families_interleave_round_robin_and_each_cycles_on_its_own():
    slots, _ = next_slots(SOURCES, Cursor(), 9)
    assert names(slots) == [("os", 0, 0), ("db", 0, 0), ("kg", 0, 0),
                            ("os", 1, 0), ("db", 1, 0), ("kg", 0, 1),
                            ("os", 0, 1), ("db", 2, 0), ("kg", 0, 2)]


def test_position_of_inverts_slot_at():
    assert all(position_of(SOURCES, slot_at(SOURCES, k)) == k for k in range(200))
    with pytest.raises(ValueError):
        position_of(SOURCES, Slot("webshop", "train", 0, 0))
    with pytest.raises(ValueError):
        position_of(SOURCES, Slot("os", "train", 2, 0))


WEIGHTED = (TaskSource(task="calc", split="rl", count=5, weight=3), TaskSource(task="os", split="train", count=2),
            TaskSource(task="db", split="train", count=3, weight=2))


def test_a_weighted_source_takes_that_many_groups_per_turn_and_still_cycles_its_own_samples():
    slots, _ = next_slots(WEIGHTED, Cursor(), 12)
    assert names(slots) == [("calc", 0, 0), ("calc", 1, 0), ("calc", 2, 0), ("os", 0, 0), ("db", 0, 0), ("db", 1, 0),
                            ("calc", 3, 0), ("calc", 4, 0), ("calc", 0, 1), ("os", 1, 0), ("db", 2, 0), ("db", 0, 1)]


def test_position_of_inverts_slot_at_with_weights():
    assert all(position_of(WEIGHTED, slot_at(WEIGHTED, k)) == k for k in range(300))
    with pytest.raises(ValueError):
        position_of(WEIGHTED, Slot("calc", "rl", 5, 0))


def test_a_restart_with_weights_resumes_where_it_stopped():
    first, cursor = next_slots(WEIGHTED, Cursor(), 7)
    assert cursor_from_dispatched(WEIGHTED, first) == cursor
    again, _ = next_slots(WEIGHTED, cursor_from_dispatched(WEIGHTED, first), 5)
    assert again == next_slots(WEIGHTED, Cursor(), 12)[0][7:]


def test_group_id_is_deterministic_and_distinguishes_every_field():
    base = group_id("run", "os", "train", 1, 0)
    assert base == group_id("run", "os", "train", 1, 0) and len(base) == 32
    others = {group_id("r2", "os", "train", 1, 0), group_id("run", "db", "train", 1, 0),
              group_id("run", "os", "dev", 1, 0), group_id("run", "os", "train", 2, 0),
              group_id("run", "os", "train", 1, 1)}
    assert base not in others and len(others) == 5


def test_each_group_is_requested_n_times_with_the_task_requested_fields():
    events, cursor = plan_training("run", SETTINGS, Cursor(), groups_in_flight=0, policy_version=7, now_ms=99)
    assert len(events) == 4 * 3 and cursor == Cursor(4)  # in-flight bound 2 x batch_size = 4 groups
    fields = {f["name"] for f in codec().schema("task_requested")["fields"]}
    for e in events:
        assert set(e) == fields
        encode("task_requested", e)
    first = events[:3]
    assert [e["member"] for e in first] == [0, 1, 2]
    assert {e["group_id"] for e in first} == {group_id("run", "os", "train", 0, 0)}
    assert all(e["group_size"] == 3 and not e["validation"] and e["policy_version"] == 7 for e in first)


def test_in_flight_bound_limits_dispatch():
    assert SETTINGS.in_flight_bound == 4
    assert in_flight({"a", "b", "c"}, trained={"a"}) == 2
    assert in_flight({"a", "b", "c"}, trained={"a"}, released={"c"}) == 1
    assert dispatch_budget(SETTINGS, 2) == 2 and dispatch_budget(SETTINGS, 5) == 0
    events, cursor = plan_training("run", SETTINGS, Cursor(4), groups_in_flight=4, policy_version=0, now_ms=0)
    assert events == [] and cursor == Cursor(4)


def test_explicit_in_flight_bound_overrides_the_default():
    assert SETTINGS.model_copy(update={"max_in_flight_groups": 10}).in_flight_bound == 10


def test_restart_resumes_without_redispatching_or_skipping():
    first, _ = next_slots(SOURCES, Cursor(), 5)
    cursor = cursor_from_dispatched(SOURCES, first)
    assert cursor == Cursor(5)
    resumed, _ = next_slots(SOURCES, cursor, 4)
    uninterrupted, _ = next_slots(SOURCES, Cursor(), 9)
    assert first + resumed == uninterrupted


def test_restart_with_a_gap_fills_the_gap_and_skips_what_was_already_sent():
    all_slots, _ = next_slots(SOURCES, Cursor(), 8)
    sent = [s for k, s in enumerate(all_slots) if k != 2]  # position 2 was lost before its produce
    cursor = cursor_from_dispatched(SOURCES, sent)
    assert cursor == Cursor(2, frozenset({3, 4, 5, 6, 7}))
    resumed, after = next_slots(SOURCES, cursor, 2)
    assert resumed == [all_slots[2], slot_at(SOURCES, 8)] and after == Cursor(9)


def test_validation_is_due_every_val_interval_versions_once():
    assert validation_round_due(0, [], SETTINGS) == 0
    assert validation_round_due(24, [0], SETTINGS) is None
    assert validation_round_due(25, [0], SETTINGS) == 1
    assert validation_round_due(60, [0, 1], SETTINGS) == 2
    assert validation_round_due(0, [], SETTINGS.model_copy(update={"val_before_train": False})) is None


def test_validation_round_dispatches_every_sample_with_n_four():
    events = plan_validation("run", SETTINGS, 1, policy_version=25, now_ms=0)
    assert len(events) == 2 * 4
    assert all(e["validation"] and e["group_size"] == 4 and e["epoch"] == 1 and e["split"] == "dev" for e in events)
    assert {e["sample_index"] for e in events} == {0, 1}
    assert plan_validation("run", SETTINGS, 2, 50, 0)[0]["group_id"] != events[0]["group_id"]


def test_a_split_used_for_training_and_validation_is_refused():
    with pytest.raises(ValueError, match="training and validation"):
        DispatcherSettings(sources=SOURCES, validation_sources=(SOURCES[0],))
