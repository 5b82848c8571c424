"""Which engine takes a turn: planned pool, fallback to current, back-off after failures."""

from __future__ import annotations

import asyncio

from env_workers.engines import EnginePool, EngineState, choose_engine, turn_seed
from schemas import samples

NOW, TIMEOUT = 100_000, 10_000


def engine(engine_id: str, pool: str, **kw) -> EngineState:
    return EngineState(engine_id, pool, f"http://{engine_id}", "m", **{"seen_ms": NOW, **kw})


def test_planned_pool_is_used_when_it_has_a_healthy_engine():
    chosen = choose_engine([engine("c0", "current"), engine("s0", "stale")], "stale", NOW, TIMEOUT)
    assert chosen is not None and chosen.engine_id == "s0"


def test_stale_turn_falls_back_to_current_when_stale_engines_are_unhealthy_or_silent():
    engines = [engine("c0", "current"), engine("s0", "stale", healthy=False),
               engine("s1", "stale", seen_ms=NOW - TIMEOUT - 1)]
    chosen = choose_engine(engines, "stale", NOW, TIMEOUT)
    assert chosen is not None and chosen.pool == "current"


def test_least_loaded_engine_of_the_pool_is_chosen():
    engines = [engine("c0", "current", in_flight=3), engine("c1", "current", in_flight=1)]
    assert choose_engine(engines, "current", NOW, TIMEOUT).engine_id == "c1"


def test_an_engine_busy_with_an_update_is_passed_over_for_an_idle_one_of_the_same_pool_but_still_used_alone():
    busy = engine("c0", "current", busy=True)
    assert choose_engine([busy, engine("c1", "current", in_flight=9)], "current", NOW, TIMEOUT).engine_id == "c1"
    assert choose_engine([busy], "current", NOW, TIMEOUT).engine_id == "c0"
    # A busy stale engine still takes its stale turn: the plan's pool share is kept, the turn waits seconds.
    assert choose_engine([engine("s0", "stale", busy=True), engine("c1", "current")], "stale", NOW,
                         TIMEOUT).engine_id == "s0"


def test_a_heartbeat_saying_busy_marks_the_engine_busy_until_one_says_otherwise():
    pool = _pool("r1")
    pool.update({**samples.engine_heartbeat(), "run": "r1", "sent_at_ms": NOW, "busy": "receive", "busy_for_ms": 800})
    assert pool.states["engine-current-0"].busy
    pool.update({**samples.engine_heartbeat(), "run": "r1", "sent_at_ms": NOW})
    assert not pool.states["engine-current-0"].busy


def test_engine_backing_off_is_used_only_when_nothing_else_is_alive():
    failed = engine("c0", "current", avoid_until_ms=NOW + 1)
    assert choose_engine([failed, engine("c1", "current", in_flight=9)], "current", NOW, TIMEOUT).engine_id == "c1"
    assert choose_engine([failed], "current", NOW, TIMEOUT).engine_id == "c0"


def test_no_engine_alive_gives_none():
    assert choose_engine([engine("c0", "current", healthy=False)], "current", NOW, TIMEOUT) is None


def test_static_engines_never_go_stale():
    assert choose_engine([engine("c0", "current", seen_ms=0, static=True)], "current", NOW, TIMEOUT) is not None


def test_turn_seed_is_stable_per_trajectory_and_turn():
    assert turn_seed("t1", 100) == turn_seed("t1", 100) != turn_seed("t1", 101)
    assert 0 <= turn_seed("t2", 5) < 2**31


def _pool(run: str | None) -> EnginePool:
    return EnginePool(stop_token_ids=[0], clock_ms=lambda: NOW, heartbeat_timeout_s=10, failure_backoff_s=1,
                      timeout_s=1, run=run)


def test_pool_of_a_run_ignores_heartbeats_of_other_runs_but_takes_those_naming_none():
    pool = _pool("r1")
    for engine_id, run in (("mine", "r1"), ("theirs", "r2"), ("old", "")):
        pool.update({**samples.engine_heartbeat(), "engine_id": engine_id, "run": run, "sent_at_ms": NOW})
    assert sorted(pool.states) == ["mine", "old"]
    asyncio.run(pool.aclose())


def test_pool_without_a_run_takes_every_heartbeat():
    pool = _pool(None)
    pool.update({**samples.engine_heartbeat(), "engine_id": "theirs", "run": "r2", "sent_at_ms": NOW})
    assert list(pool.states) == ["theirs"]
    asyncio.run(pool.aclose())
