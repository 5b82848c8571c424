"""The engine heartbeat event as the `rollstream engine` supervisor publishes it."""

from __future__ import annotations

from pipeline.engine.heartbeat import Probe, heartbeat_event
from schemas.codec import codec


def test_heartbeat_names_the_run_whose_weights_the_engine_serves():
    event = heartbeat_event(engine_id="r1.current-0", pool="current", url="http://h:8100", model="m", run="r1",
                            loaded_version=3, probe=Probe(True, 3, 1, 2, ""), sent_at_ms=5, detail="")
    assert codec().decode(codec().encode("engine_heartbeat", event), "engine_heartbeat") == event
    assert (event["run"], event["queue_depth"], event["running"]) == ("r1", 1, 2)


def _event(probe: Probe, stall_after_s: float) -> dict:
    return heartbeat_event(engine_id="e", pool="current", url="http://h", model="m", run="r", loaded_version=3,
                           probe=probe, sent_at_ms=5, stall_after_s=stall_after_s)


def test_an_engine_busy_with_an_update_is_healthy_and_says_what_it_is_doing():
    event = _event(Probe(True, 3, 4, 0, "", busy="receive", busy_for_s=1.5), stall_after_s=60)
    assert codec().decode(codec().encode("engine_heartbeat", event), "engine_heartbeat") == event
    assert (event["healthy"], event["busy"], event["busy_for_ms"]) == (True, "receive", 1500)
    assert event["detail"] == "busy (receive) for 2 s"


def test_an_engine_busy_past_its_stall_bound_is_reported_unhealthy_though_it_answers_probes():
    event = _event(Probe(True, 3, 4, 0, "", busy="join", busy_for_s=61.0), stall_after_s=60)
    assert (event["healthy"], event["busy"]) == (False, "join")
    assert event["detail"] == "stalled: busy (join) for 61 s"


def test_an_idle_engine_says_it_is_not_busy():
    event = _event(Probe(True, 3, 0, 0, ""), stall_after_s=60)
    assert (event["healthy"], event["busy"], event["busy_for_ms"], event["detail"]) == (True, "", 0, "")
