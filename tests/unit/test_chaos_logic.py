"""bench chaos's pure part: the seeded schedule, moments, episodes of two faults, recovery and the
figures."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeline.bench.chaos_logic import (
    ANY,
    BATCH_CUT,
    CHECKPOINT,
    FAULTS,
    WEIGHT_UPDATE,
    ChaosSchedule,
    ChaosSettings,
    Episode,
    Injected,
    ballast_bytes,
    chaos_table,
    drain_versions,
    episode_findings,
    redone_in,
    restarts_in,
    slow_phase,
    trained_twice,
)

ALL_MOMENTS = {WEIGHT_UPDATE, CHECKPOINT, BATCH_CUT}


def settings(**kw) -> ChaosSettings:
    return ChaosSettings(**({"minutes": 600, "pause_s": (1.0, 1.0)} | kw))


def simulate(schedule: ChaosSchedule, episodes: int) -> list[list[str]]:
    """Injects whatever is due, every moment present, each fault recovering one version after its lift."""
    out, now, version = [], 0.0, 1
    while len(out) < episodes:
        now += 1
        due = schedule.due(now, version, ALL_MOMENTS)
        if due:
            made = [Injected(n, len(out), now, version, "") for n in due]
            schedule.injected(now, version, ALL_MOMENTS, made, {})
            out.append(due)
            version += 1
            now += FAULTS[due[0]].hold_s + max(FAULTS[n].hold_s for n in due)
            for f in made:
                f.lifted_at_s = f.lifted_at_s or now
            schedule.observe(now, version, {})  # a lasting fault's lift is seen at this version
            now, version = now + 1, version + 1
            schedule.observe(now, version, {})
    return out


def test_every_kind_is_drawn_as_often_as_the_others():
    episodes = simulate(ChaosSchedule(settings(pair_probability=0.0)), 3 * len(FAULTS))
    counts = Counter(name for e in episodes for name in e)
    assert set(counts) == set(FAULTS) and set(counts.values()) == {3}


def test_two_faults_at_once_never_hit_the_same_target():
    episodes = simulate(ChaosSchedule(settings(pair_probability=1.0, seed=3)), 40)
    pairs = [e for e in episodes if len(e) == 2]
    assert len(pairs) >= 30
    assert all(FAULTS[a].target != FAULTS[b].target for a, b in pairs)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    one = simulate(ChaosSchedule(settings(seed=7)), 20)
    assert one == simulate(ChaosSchedule(settings(seed=7)), 20)
    assert one != simulate(ChaosSchedule(settings(seed=8)), 20)


def test_a_fault_waits_for_its_moment_then_goes_in_at_it():
    s = ChaosSchedule(settings(faults=("learner_kill",)))
    assert s.due(1, 1, {WEIGHT_UPDATE, BATCH_CUT}) == []
    assert s.due(2, 1, {CHECKPOINT}) == ["learner_kill"]
    f = Injected("learner_kill", 0, 2, 1, "")
    s.injected(2, 1, {CHECKPOINT}, [f], {})
    assert f.moment == CHECKPOINT


def test_a_fault_whose_moment_does_not_come_goes_in_anyway_and_says_so():
    s = ChaosSchedule(settings(faults=("streams_kill",), moment_wait_s=30))
    assert s.due(1, 1, set()) == []
    assert s.due(30, 1, set()) == []
    assert s.due(31, 1, set()) == ["streams_kill"]
    f = Injected("streams_kill", 0, 31, 1, "")
    s.injected(31, 1, set(), [f], {})
    assert f.moment == ANY


def test_nothing_is_injected_before_the_first_version_in_an_open_episode_during_a_pause_or_after_the_time():
    s = ChaosSchedule(settings(minutes=1, faults=("kafka_restart",), pause_s=(20.0, 20.0)))
    assert s.due(1, 0, set()) == []
    assert s.due(2, 1, set()) == ["kafka_restart"]
    f = Injected("kafka_restart", 0, 2, 1, "")
    s.injected(2, 1, set(), [f], {})
    assert s.due(3, 5, set()) == []  # open
    s.observe(4, 2, {})
    assert s.open is None
    assert s.due(10, 2, set()) == []  # pausing until 24
    assert s.due(25, 2, set()) == ["kafka_restart"]
    assert ChaosSchedule(settings(minutes=1)).due(60, 1, ALL_MOMENTS) == []


def test_an_episode_recovers_only_when_lifted_moved_on_past_the_lift_back_and_its_poison_is_in_dlq():
    s = ChaosSchedule(settings(faults=("engine_hang", "poison_events"), pair_probability=1.0))
    due = s.due(1, 3, ALL_MOMENTS)
    assert sorted(due) == ["engine_hang", "poison_events"]
    made = [Injected(n, 0, 1, 3, "") for n in due]
    poison = next(f for f in made if f.name == "poison_events")
    poison.poison = [("tasks", 0, 10), ("batches", 0, 4)]
    hang = next(f for f in made if f.name == "engine_hang")
    s.injected(1, 3, ALL_MOMENTS, made, {})
    assert hang.lifted_at_s is None and poison.lifted_at_s == 1
    s.observe(5, 4, {"engine_hang": True}, {("tasks", 0, 10)})
    assert hang.recovered_at_s is None and poison.recovered_at_s is None and poison.poison_found == 1
    hang.lifted_at_s = 31
    s.observe(32, 4, {"engine_hang": False}, {("tasks", 0, 10), ("batches", 0, 4)})
    assert hang.recovered_at_s is None and poison.recovery_s == 31
    s.observe(40, 4, {"engine_hang": True})  # back, but the learner has not moved since the lift
    assert hang.recovered_at_s is None and hang.version_at_lift == 4
    s.observe(41, 5, {"engine_hang": True})
    assert hang.recovery_s == 40 and s.open is None


def test_the_learner_must_move_past_the_version_it_was_at():
    s = ChaosSchedule(settings(faults=("kafka_restart",)))
    s.due(1, 4, set())
    f = Injected("kafka_restart", 0, 1, 4, "")
    s.injected(1, 4, set(), [f], {})
    s.observe(50, 4, {})
    assert s.open is not None
    s.observe(51, 5, {})
    assert s.open is None


def test_recovery_waits_until_work_dispatched_after_the_lift_is_trained():
    # bound 4 groups, 2 a batch: what was in flight at the lift fills at most two batches
    assert drain_versions(4, 2) == 3 and drain_versions(5, 2) == 4 and drain_versions(1, 1) == 2
    s = ChaosSchedule(settings(faults=("kafka_restart",), drain_versions=drain_versions(4, 2)))
    s.due(1, 4, set())
    f = Injected("kafka_restart", 0, 1, 4, "")
    s.injected(1, 4, set(), [f], {})
    s.observe(10, 5, {})
    s.observe(20, 6, {})  # two batches: could be the groups in flight at the restart alone
    assert s.open is not None and f.version_at_lift == 4
    s.observe(30, 7, {})
    assert s.open is None and f.recovery_s == 29
    with pytest.raises(ValueError, match="positive"):
        drain_versions(0, 2)
    with pytest.raises(ValueError, match="drain_versions"):
        ChaosSettings(minutes=1, drain_versions=0)


def test_a_fault_the_machine_cannot_inject_counts_as_nothing():
    s = ChaosSchedule(settings(faults=("kafka_disk_full",)))
    s.due(1, 1, set())
    f = Injected("kafka_disk_full", 0, 1, 1, "", injected=False, detail="not injected: no space")
    s.injected(1, 1, set(), [f], {})
    assert s.open is None
    table = chaos_table(s.episodes, [{}], [{}], {}, trained_twice([], []), [])
    assert table["per_fault"]["kafka_disk_full"]["count"] == 0
    assert table["per_fault"]["kafka_disk_full"]["not_injected"] == 1
    assert table["ok"] and table["ratio"] == 0


def test_when_the_time_is_up_the_open_episode_gets_the_recovery_limit():
    s = ChaosSchedule(settings(minutes=1, faults=("kafka_restart",), recovery_limit_s=100))
    s.due(50, 1, set())
    s.injected(50, 1, set(), [Injected("kafka_restart", 0, 50, 1, "")], {})
    assert not s.done(59)
    assert not s.done(150)
    assert s.done(161)
    s2 = ChaosSchedule(settings(minutes=1))
    assert not s2.done(59) and s2.done(60)


def test_settings_refuse_unknown_faults_no_time_and_a_probability_outside_zero_one():
    with pytest.raises(ValueError, match="unknown faults"):
        ChaosSettings(minutes=1, faults=("disk_on_fire",))
    with pytest.raises(ValueError, match="minutes"):
        ChaosSettings(minutes=0)
    with pytest.raises(ValueError, match="pair_probability"):
        ChaosSettings(minutes=1, pair_probability=1.5)


def batch(bid: str, *trajectories: str) -> dict:
    return {"batch_id": bid, "items": [{"trajectory": {"trajectory_id": t}} for t in trajectories]}


def test_batches_and_trajectories_trained_twice_are_counted_from_what_was_trained():
    batches = [batch("b1", "t1", "t2"), batch("b2", "t2", "t3"), batch("b3", "t1"), batch("b4", "t9", "t9x")]
    weights = [{"version": 0, "batch_id": None}, {"version": 1, "batch_id": "b1"}, {"version": 2, "batch_id": "b2"},
               {"version": 3, "batch_id": "b1"}, {"version": 4, "batch_id": "b3"}]
    twice = trained_twice(batches, weights)
    # b1 twice; t2 in b1 and b2, t1 in b1 and b3; b4 never trained
    assert twice == {"batches": 1, "trajectories": 2, "trained_batches": 3, "trained_trajectories": 3}
    assert trained_twice([batch("b1", "t1")], [{"version": 1, "batch_id": "b1"}])["trajectories"] == 0


def episode(index: int, at: float, *faults: Injected, before: dict | None = None) -> Episode:
    return Episode(index, list(faults), at, before or {})


def test_each_killed_process_may_come_back_once_anything_else_is_a_finding():
    pair = episode(0, 1, Injected("learner_kill", 0, 1, 1, "", killed="learner"),
                   Injected("kafka_restart", 0, 1, 1, ""))
    assert episode_findings(pair, {"learner": 1}) == []
    found = episode_findings(pair, {"learner": 2, "streams": 1})
    assert found == ["learner exited during learner_kill + kafka_restart and was restarted 1 more times",
                     "streams exited during learner_kill + kafka_restart and was restarted: it should ride through it"]


def test_restarts_and_redone_work_fall_in_the_window_of_the_episode_they_follow():
    e0 = episode(0, 10, Injected("kafka_restart", 0, 10, 1, ""), before={"learner": 0})
    e1 = episode(1, 100, Injected("learner_kill", 1, 100, 3, "", killed="learner"), before={"learner": 1})
    assert restarts_in([e0, e1], {"learner": 2}) == [{"learner": 1}, {"learner": 1}]
    started = 1_000_000
    repeats = {"trajectories": [started + 5_000, started + 20_000, started + 150_000], "batches": []}
    assert redone_in(repeats, [e0, e1], started) == [{"trajectories": 1, "batches": 0},
                                                     {"trajectories": 1, "batches": 0}]


def test_the_ratio_is_losses_plus_double_training_and_anything_left_behind_fails_the_run():
    unrecovered = episode(0, 1, Injected("engine_hang", 0, 1, 1, "", lifted_at_s=31))
    verify = {"checks": [{"name": "groups_reach_batches", "mismatches": [1, 2]},
                         {"name": "batches_trained_once", "mismatches": [1]}]}
    twice = {"batches": 1, "trajectories": 3, "trained_batches": 9, "trained_trajectories": 30}
    table = chaos_table([unrecovered], [{}], [{}], verify, twice, [])
    assert table["losses"] == 1 + 2  # the episode, the two groups (the batch trained twice counts once, below)
    assert table["ratio"] == 3 + 1 + 3 and not table["ok"]
    clean = episode(0, 1, Injected("kafka_restart", 0, 1, 1, "", lifted_at_s=1, recovered_at_s=20))
    ok = chaos_table([clean], [{}], [{}], {}, {"batches": 0, "trajectories": 0, "trained_batches": 1,
                                               "trained_trajectories": 2}, [])
    assert ok["ok"] and ok["ratio"] == 0 and ok["per_fault"]["kafka_restart"]["recovery_s"]["p50"] == 19
    left = chaos_table([clean], [{}], [{}], {}, {"batches": 0, "trajectories": 0, "trained_batches": 1,
                                                 "trained_trajectories": 2}, ["123 rollstream engine run-x"])
    assert left["ratio"] == 0 and not left["ok"]


def test_the_ballast_leaves_the_headroom_free_and_a_slow_worker_is_stopped_two_seconds_in_three():
    assert ballast_bytes(10_000, 3_000) == 7_000
    assert ballast_bytes(2_000, 3_000) == 0
    assert [slow_phase(t) for t in (0, 1, 1.9, 2, 2.9, 3, 5.5)] == [True, True, True, False, False, True, False]
