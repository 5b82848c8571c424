"""Per-turn pool routing plans and the engine registry."""

import pytest

from schemas.codec import encode
from streams.routing import (
    REASON_MIXED, REASON_NO_STALE_ENGINE, REASON_RATIO_ZERO, REASON_STALE_BEHIND, REASON_VALIDATION,
    PoolState, fold_heartbeat, is_news, plan_turn_pools, pool_states, routing_seed, serves_run, stale_schedule,
    task_event,
)

STALE_OK = PoolState(engines=("s0",), loaded_version=25)


def plan(member=0, stale_pool=STALE_OK, validation=False, learner_version=30, max_stale_lag=5,
         stale_ratio=0.25, group_id="g1", mode="turn"):
    return plan_turn_pools("run", group_id, member, 20, stale_ratio, stale_pool, validation, max_stale_lag,
                           learner_version=learner_version, stale_step=25, mode=mode)


def heartbeat(engine_id, pool, version, sent, healthy=True, run="run"):
    return {"engine_id": engine_id, "pool": pool, "url": f"http://{engine_id}", "model": "m",
            "loaded_version": version, "queue_depth": 0, "running": 0, "healthy": healthy,
            "detail": "", "sent_at_ms": sent, "run": run}


def test_router_of_a_run_takes_its_own_engines_and_those_naming_no_run_only():
    assert serves_run(heartbeat("s0", "stale", 0, 0, run="run"), "run")
    assert serves_run(heartbeat("s0", "stale", 0, 0, run=""), "run")
    assert not serves_run(heartbeat("s0", "stale", 0, 0, run="other"), "run")
    assert serves_run(heartbeat("s0", "stale", 0, 0, run="other"), None)


def test_plan_is_reproducible_from_run_group_and_member():
    assert plan() == plan()
    assert plan().seed == routing_seed("run", "g1", 0)
    assert plan(member=1).seed != plan().seed


def test_seed_is_a_known_sha256_value_not_pythons_salted_hash():
    # pinned: a replay in another process (another PYTHONHASHSEED) must draw the same plan
    assert routing_seed("run", "g1", 0) == routing_seed("run", "g1", 0)
    assert 0 <= routing_seed("run", "g1", 0) < 2**63
    assert routing_seed("run", "g1", 0) == 5579803540676337787


def test_mixed_plan_has_one_pool_per_turn_and_records_its_ratio():
    p = plan()
    assert len(p.turn_pools) == 20 and set(p.turn_pools) <= {"current", "stale"}
    assert (p.reason, p.stale_ratio, p.stale_version) == (REASON_MIXED, 0.25, 25)


def test_realized_stale_share_over_many_draws_is_close_to_ratio():
    pools = [pool for m in range(500) for pool in plan(member=m, group_id=f"g{m % 7}").turn_pools]
    share = pools.count("stale") / len(pools)
    assert abs(share - 0.25) < 0.015  # 10,000 turns: 5 standard deviations is about 0.022


def test_validation_tasks_go_to_the_current_pool_only():
    p = plan(validation=True)
    assert p.turn_pools == ["current"] * 20 and p.reason == REASON_VALIDATION and p.stale_ratio == 0.0


def test_no_healthy_stale_engine_routes_current_only():
    for pool in (None, PoolState(engines=(), loaded_version=None)):
        p = plan(stale_pool=pool)
        assert p.turn_pools == ["current"] * 20 and p.reason == REASON_NO_STALE_ENGINE


def test_stale_pool_too_far_behind_its_schedule_routes_current_only():
    # learner at 57: schedule 50; stale pool on 25 trails it by 25 > 5
    p = plan(learner_version=57)
    assert p.turn_pools == ["current"] * 20 and p.reason == REASON_STALE_BEHIND
    assert p.stale_version == 25


def test_stale_pool_within_its_lag_keeps_mixing():
    assert plan(learner_version=54, stale_pool=PoolState(("s0",), 45)).reason == REASON_MIXED
    assert plan(learner_version=54, stale_pool=PoolState(("s0",), 44)).reason == REASON_STALE_BEHIND


def test_zero_stale_ratio_routes_current_only_with_reason():
    p = plan(stale_ratio=0.0)
    assert p.turn_pools == ["current"] * 20 and p.reason == REASON_RATIO_ZERO


def test_zero_stale_ratio_never_routes_a_turn_to_the_stale_pool_in_either_mode():
    pools = {pool for mode in ("turn", "trajectory") for m in range(200)
             for pool in plan(member=m, group_id=f"g{m % 7}", stale_ratio=0.0, mode=mode).turn_pools}
    assert pools == {"current"}


def test_trajectory_mode_routes_every_turn_of_a_trajectory_to_one_pool():
    plans = [plan(member=m, group_id=f"g{m % 7}", mode="trajectory") for m in range(800)]
    assert all(len(p.turn_pools) == 20 and len(set(p.turn_pools)) == 1 for p in plans)
    assert all((p.reason, p.stale_ratio) == (REASON_MIXED, 0.25) for p in plans)
    share = sum(p.turn_pools[0] == "stale" for p in plans) / len(plans)
    assert abs(share - 0.25) < 0.08  # 800 trajectories: 5 standard deviations is about 0.077
    assert plan(mode="trajectory") == plan(mode="trajectory")  # reproducible from its seed alone


def test_trajectory_mode_falls_back_to_current_only_as_turn_mode_does():
    for kw in ({"validation": True}, {"stale_pool": None}, {"learner_version": 57}):
        assert plan(mode="trajectory", **kw).turn_pools == ["current"] * 20


def test_turn_mode_is_the_default_and_mixes_pools_within_a_trajectory():
    assert plan_turn_pools("run", "g1", 0, 20, 0.25, STALE_OK, False, 5, learner_version=30, stale_step=25) == plan()
    assert any(len(set(plan(member=m).turn_pools)) == 2 for m in range(20))


def test_stale_schedule_is_latest_multiple_of_stale_step():
    assert [stale_schedule(v, 25) for v in (0, 24, 25, 49, 50)] == [0, 0, 25, 25, 50]


def test_task_event_matches_the_task_schema():
    request = {"run": "run", "group_id": "g1", "member": 0, "group_size": 8, "task": "os", "split": "train",
               "sample_index": 3, "epoch": 0, "validation": False, "policy_version": 30, "dispatched_at_ms": 1}
    event = task_event(request, plan(), routed_at_ms=2)
    encode("task", event)
    assert event["routing_seed"] == plan().seed and event["turn_pools"] == plan().turn_pools


def test_registry_keeps_newest_heartbeat_per_engine_regardless_of_order():
    new, old = heartbeat("s0", "stale", 25, sent=2000), heartbeat("s0", "stale", 0, sent=1000)
    assert fold_heartbeat(fold_heartbeat({}, new), old)["s0"]["loaded_version"] == 25
    assert fold_heartbeat(fold_heartbeat({}, old), new)["s0"]["loaded_version"] == 25


def test_an_engine_silent_longer_than_the_forget_horizon_leaves_the_registry_and_returns_with_its_next_beat():
    registry = fold_heartbeat({}, heartbeat("gone", "stale", 3, sent=1_000), forget_after_ms=10_000)
    registry = fold_heartbeat(registry, heartbeat("s0", "stale", 4, sent=11_000), forget_after_ms=10_000)
    assert sorted(registry) == ["gone", "s0"]  # exactly the horizon: kept
    registry = fold_heartbeat(registry, heartbeat("s0", "stale", 4, sent=11_001), forget_after_ms=10_000)
    assert sorted(registry) == ["s0"]
    registry = fold_heartbeat(registry, heartbeat("gone", "stale", 5, sent=11_002), forget_after_ms=10_000)
    assert sorted(registry) == ["gone", "s0"] and registry["gone"]["loaded_version"] == 5
    assert sorted(fold_heartbeat(registry, heartbeat("s1", "stale", 5, sent=99_999))) == ["gone", "s0", "s1"]


def test_pool_state_counts_only_live_healthy_engines_and_their_oldest_version():
    registry = {}
    for hb in (heartbeat("c0", "current", 30, sent=9_000), heartbeat("c1", "current", 29, sent=9_500),
               heartbeat("s0", "stale", 25, sent=9_000), heartbeat("s1", "stale", 0, sent=1_000),
               heartbeat("s2", "stale", 0, sent=9_000, healthy=False)):
        registry = fold_heartbeat(registry, hb)
    states = pool_states(registry, now_ms=10_000, liveness_ms=5_000)
    assert states["current"] == PoolState(("c0", "c1"), 29)
    assert states["stale"] == PoolState(("s0",), 25)


def test_pool_without_live_engines_is_unhealthy():
    registry = fold_heartbeat({}, heartbeat("s0", "stale", 25, sent=0))
    stale = pool_states(registry, now_ms=60_000, liveness_ms=30_000)["stale"]
    assert not stale.healthy and stale.loaded_version is None
    assert plan(stale_pool=stale).reason == REASON_NO_STALE_ENGINE


@pytest.mark.parametrize("member", range(3))
def test_plans_differ_between_members_of_one_group(member):
    assert plan(member=member).turn_pools != plan(member=member + 10).turn_pools


def test_a_steady_heartbeat_is_news_to_the_router_only_once_per_refresh_period():
    first = heartbeat("s0", "stale", 3, 1_000)
    assert is_news(None, first, 10_000)  # an engine the router has not heard of
    assert not is_news(first, heartbeat("s0", "stale", 3, 3_000), 10_000)
    assert not is_news(first, {**heartbeat("s0", "stale", 3, 9_000), "queue_depth": 7, "running": 4}, 10_000)
    assert is_news(first, heartbeat("s0", "stale", 3, 11_000), 10_000)
    assert not is_news(first, heartbeat("s0", "stale", 4, 500), 10_000)  # older than the one held


@pytest.mark.parametrize("change", [{"loaded_version": 4}, {"healthy": False}, {"pool": "current"}, {"run": ""}])
def test_a_heartbeat_that_changes_what_routing_reads_is_news_at_once(change):
    first = heartbeat("s0", "stale", 3, 1_000)
    assert is_news(first, {**heartbeat("s0", "stale", 3, 3_000), **change}, 10_000)
