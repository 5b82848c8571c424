"""Each long-running process's Prometheus endpoint (schemas/prometheus.py) and the figures the
components set on it. The endpoints of a real run are checked in tests/integration/test_up_end_to_end.py."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import REGISTRY, Gauge
from pydantic import ValidationError

import pipeline.cli  # noqa: F401 - imports every component's modules, as the `rollstream` command does
from learner import process as learner_process
from learner.settings import LearnerSettings
from pipeline.dispatch import dispatcher
from pipeline.engine import heartbeat
from pipeline.engine.heartbeat import Probe, heartbeat_event
from schemas.prometheus import process_registry, serve_metrics


def test_no_port_serves_nothing(capsys):
    assert serve_metrics(None, "learner", learner_process.PROMETHEUS) is None
    assert capsys.readouterr().err == ""


def test_port_zero_serves_the_processes_metrics_on_a_free_port_and_says_where(capsys):
    gauge = Gauge("test_served_value", "A value.", registry=None)
    gauge.set(7)
    port = serve_metrics(0, "test-process", [gauge])
    assert port is not None and port > 0
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "test_served_value 7.0" in body
    assert "process_cpu_seconds_total" in body  # the process's own figures, as the default registry has them
    assert capsys.readouterr().err == f"metrics: test-process http://127.0.0.1:{port}/metrics\n"


def test_a_port_that_is_taken_is_said_and_the_process_goes_on_without_metrics(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_metrics(port, "learner", learner_process.PROMETHEUS) is None
    assert capsys.readouterr().err.startswith(f"metrics: learner not served, port {port}: ")


def test_the_default_registry_holds_none_of_the_components_metrics():
    # The `rollstream` command imports every component: a metric registered by default would show, at 0, in
    # every other process's endpoint too.
    names = [m.name for m in REGISTRY.collect()]
    assert [n for n in names if n.startswith("rollstream_")] == []


def test_a_process_registry_serves_only_that_components_metrics():
    registry = process_registry(learner_process.PROMETHEUS)
    names = {m.name for m in registry.collect()}
    assert {n for n in names if n.startswith("rollstream_")} == {
        "rollstream_learner_step", "rollstream_learner_weight_version", "rollstream_learner_loss",
        "rollstream_learner_kl", "rollstream_learner_clip_fraction", "rollstream_learner_tokens_per_second"}


def test_the_learner_shows_the_newest_steps_loss_kl_clip_fraction_and_throughput():
    registry = process_registry(learner_process.PROMETHEUS)
    learner_process.export_step(5, 6, {"actor/loss": 0.25, "actor/kl_loss": 1e-3, "actor/pg_clipfrac": 0.125,
                                       "perf/tokens_per_s": 900.0, "actor/entropy": 2.0})
    values = {name: registry.get_sample_value(f"rollstream_learner_{name}")
              for name in ("step", "weight_version", "loss", "kl", "clip_fraction", "tokens_per_second")}
    assert values == {"step": 5, "weight_version": 6, "loss": 0.25, "kl": 1e-3, "clip_fraction": 0.125,
                      "tokens_per_second": 900.0}


def test_the_engine_supervisor_shows_each_heartbeats_version_queue_and_busy_state():
    registry = process_registry(heartbeat.PROMETHEUS)
    heartbeat.export(heartbeat_event(engine_id="e", pool="current", url="http://h", model="m", run="r",
                                     loaded_version=4, probe=Probe(True, 4, 3, 2, "", busy="load", busy_for_s=1.0),
                                     sent_at_ms=5))
    figures = ("weight_version", "requests_waiting", "requests_running", "busy", "healthy")
    assert [registry.get_sample_value(f"rollstream_engine_{name}") for name in figures] == [4, 3, 2, 1, 1]
    heartbeat.export(heartbeat_event(engine_id="e", pool="current", url="http://h", model="m", run="r",
                                     loaded_version=4, probe=Probe(False, None, 0, 0, "probe failed"), sent_at_ms=6))
    assert [registry.get_sample_value(f"rollstream_engine_{name}") for name in ("busy", "healthy")] == [0, 0]


class _Producer:
    def send(self, topic, value, key=None):
        pass

    def flush(self):
        pass


def test_the_dispatcher_counts_the_task_requests_it_sent_by_kind():
    registry = process_registry(dispatcher.PROMETHEUS)

    def sent(kind: str) -> float:
        return registry.get_sample_value("rollstream_dispatcher_tasks_sent_total", {"kind": kind}) or 0.0

    before = sent("train"), sent("validation")
    requests = [{"group_id": "g", "validation": False}] * 3 + [{"group_id": "v", "validation": True}]
    dispatcher._send(_Producer(), requests)
    assert (sent("train") - before[0], sent("validation") - before[1]) == (3, 1)


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_metrics_port_outside_the_port_range_is_refused(port):
    with pytest.raises(ValidationError, match="metrics_port"):
        LearnerSettings(metrics_port=port)
