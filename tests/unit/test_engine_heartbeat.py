"""The engine heartbeat event as the `rollstream engine` supervisor publishes it."""

from __future__ import annotations

import httpx

from pipeline.engine import heartbeat
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


class RecordingProducer:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, topic: str, value: dict, key: str | None = None) -> None:
        self.sent.append(value)

    def poll(self, timeout: float = 0.0) -> None:
        pass


def engine_answers(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/rollstream/state":
        return httpx.Response(200, json={"version": 7, "updating": False, "in_flight": 0, "last_error": ""})
    if request.url.path == "/metrics":
        return httpx.Response(200, text='vllm:num_requests_waiting{m="x"} 2.0\nvllm:num_requests_running{m="x"} 3.0\n')
    return httpx.Response(200)


def test_every_probe_of_a_heartbeat_goes_through_one_http_client(monkeypatch):
    # A client per request (httpx.get) loads the CA bundle every time: 17 ms of CPU, three times a beat.
    made, requests, real_client = [], [], httpx.Client

    def client(**kwargs) -> httpx.Client:
        made.append(kwargs)
        return real_client(transport=httpx.MockTransport(lambda r: requests.append(r.url.path) or engine_answers(r)))

    monkeypatch.setattr(heartbeat.httpx, "Client", client)
    producer = RecordingProducer()
    beats = heartbeat.Heartbeat(producer, engine_id="e", pool="current", url="http://engine", model="m",
                                interval_s=2.0, probe_timeout_s=1.0, initial_version=0)
    for _ in range(3):
        beats.beat()
    assert len(made) == 1 and requests == ["/health", "/rollstream/state", "/metrics"] * 3
    assert [(e["loaded_version"], e["queue_depth"], e["running"], e["healthy"]) for e in producer.sent] == [
        (7, 2, 3, True)] * 3


def test_an_engine_that_does_not_answer_is_an_unhealthy_probe_not_an_error():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    seen = heartbeat.probe(httpx.Client(transport=httpx.MockTransport(refuse)), "http://engine", 1.0)
    assert (seen.healthy, seen.version) == (False, None) and "connection refused" in seen.detail
