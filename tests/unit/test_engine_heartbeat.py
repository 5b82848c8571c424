"""The engine heartbeat event as the `rollstream engine` supervisor publishes it."""

from __future__ import annotations

from pipeline.engine.heartbeat import Probe, heartbeat_event
from schemas.codec import codec


def test_heartbeat_names_the_run_whose_weights_the_engine_serves():
    event = heartbeat_event(engine_id="r1.current-0", pool="current", url="http://h:8100", model="m", run="r1",
                            loaded_version=3, probe=Probe(True, 3, 1, 2, ""), sent_at_ms=5, detail="")
    assert codec().decode(codec().encode("engine_heartbeat", event), "engine_heartbeat") == event
    assert (event["run"], event["queue_depth"], event["running"]) == ("r1", 1, 2)
