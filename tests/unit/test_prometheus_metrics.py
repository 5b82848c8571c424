"""Each long-running process's Prometheus endpoint (schemas/prometheus.py) and the figures the
components set on it. The endpoints of a real run are checked in tests/integration/test_up_end_to_end.py."""

from __future__ import annotations

import socket

import httpx
import pytest
import typer
from prometheus_client import REGISTRY, Gauge
from pydantic import ValidationError

import pipeline.cli  # noqa: F401 - imports every component's modules, as the `rollstream` command does
from env_workers.worker_settings import EnvWorkerSettings
from learner import process as learner_process
from learner.settings import LearnerSettings
from pipeline.dispatch import dispatcher
from pipeline.dispatch.logic import DispatcherSettings, TaskSource
from pipeline.engine import heartbeat
from pipeline.engine.heartbeat import Probe, heartbeat_event
from pipeline.engine.supervisor import EngineSettings
from schemas.prometheus import metrics_url, process_registry, reachable_host, serve_metrics
from streams.settings import WorkerSettings as StreamsWorkerSettings


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
    assert capsys.readouterr().err.startswith(f"metrics: learner not served, port {port} on 127.0.0.1: ")


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


def test_a_process_told_to_serve_on_every_address_announces_a_url_it_can_be_reached_at(capsys):
    gauge = Gauge("test_everywhere_value", "A value.", registry=None)
    gauge.set(3)
    port = serve_metrics(0, "test-process", [gauge], host="0.0.0.0")
    assert port is not None and port > 0
    announced = capsys.readouterr().err
    assert announced == f"metrics: test-process http://127.0.0.1:{port}/metrics\n"  # 0.0.0.0 is no place to connect
    url = announced.split()[-1]
    assert "test_everywhere_value 3.0" in httpx.get(url, timeout=10).text


@pytest.mark.parametrize(("bound", "reached"), [
    ("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("0:0:0:0:0:0:0:0", "::1"),
    ("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("::1", "::1"), ("localhost", "localhost"),
    ("learner.rollstream-learner", "learner.rollstream-learner"),
])
def test_a_wildcard_address_is_reached_at_the_loopback_and_any_other_at_itself(bound, reached):
    assert reachable_host(bound) == reached


def test_an_ipv6_address_is_bracketed_in_the_metrics_url():
    assert metrics_url(9100, "::1") == "http://[::1]:9100/metrics"
    assert metrics_url(9100) == "http://127.0.0.1:9100/metrics"
    assert metrics_url(9100, "learner.rollstream-learner") == "http://learner.rollstream-learner:9100/metrics"


_COMPONENT_SETTINGS = {
    "learner": LearnerSettings,
    "streams worker": StreamsWorkerSettings,
    "env worker": EnvWorkerSettings,
    "dispatcher": lambda **kw: DispatcherSettings(sources=(TaskSource(task="calc", split="train", count=1),), **kw),
    "engine supervisor": EngineSettings,
}


@pytest.mark.parametrize("component", list(_COMPONENT_SETTINGS))
def test_every_component_serves_metrics_on_loopback_unless_its_settings_name_another_address(component):
    settings = _COMPONENT_SETTINGS[component]
    assert settings().metrics_host == "127.0.0.1"
    for host in ("0.0.0.0", "::", "10.1.2.3", "learner.rollstream-learner"):
        assert settings(metrics_port=9100, metrics_host=host).metrics_host == host


@pytest.mark.parametrize("component", list(_COMPONENT_SETTINGS))
@pytest.mark.parametrize("host", ["", "http://0.0.0.0", "0.0.0.0:9100", "two words", "-bad-"])
def test_a_metrics_host_that_is_no_address_to_bind_is_refused(component, host):
    with pytest.raises(ValidationError, match="metrics_host"):
        _COMPONENT_SETTINGS[component](metrics_host=host)


def _commands(command, path=()):
    if hasattr(command, "commands"):  # a group (typer carries its own click: no isinstance check)
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), {p.name: p for p in command.params}


def test_every_command_that_takes_a_metrics_port_takes_a_metrics_host_that_defaults_to_loopback():
    served = {path: params for path, params in _commands(typer.main.get_command(pipeline.cli.app))
              if "metrics_port" in params}
    assert set(served) >= {"engine", "env-worker", "learner", "dispatch", "streams worker"}
    for path, params in served.items():
        assert "--metrics-host" in params["metrics_host"].opts, path
        # None: the --settings file's, 127.0.0.1 by default
        assert params["metrics_host"].default in ("127.0.0.1", None), path
