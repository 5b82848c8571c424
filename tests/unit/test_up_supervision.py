"""`rollstream up` restarts a process that died on its own, a bounded number of times."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.engine.launch import EngineProcess
from pipeline.run.interrupts import Interrupted, catch_interrupts
from pipeline.run.plan import Child, with_metrics_port
from pipeline.run.supervision import RestartBudget, RunFailed, Stack, last_words, stop_waves


def _wait_exit(stack: Stack) -> None:
    deadline = time.monotonic() + 10
    while any(c.process.poll() is None for c in stack.children):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_dead_process_is_restarted_with_its_restart_arguments_then_the_run_fails(tmp_path):
    said: list[str] = []
    stack = Stack(tmp_path, max_restarts=2)
    stack.start(Child("worker", ("sh", "-c", 'echo "args:$0"; exit 3'), restart_args=("again",)))
    for _ in range(2):
        _wait_exit(stack)
        stack.supervise(said.append)
    _wait_exit(stack)
    with pytest.raises(RunFailed, match="worker exited with 3 after 2 restarts"):
        stack.supervise(said.append)
    assert stack.restarts == {"worker": 2}
    assert "args:again" in (tmp_path / "worker.log").read_text()
    assert said[0] == "worker exited with 3: restarting it (1 of 2); its last words: args:sh"


def test_a_restart_names_the_last_line_the_process_wrote_past_kafka_client_noise_and_progress_bars():
    tail = ("step 5 v5 pg_loss +0.0\n"
            "rollstream learner: Kafka: KafkaError{code=NOT_COORDINATOR}\n"
            "%3|1796.1|FAIL|learner#consumer-3| [thrd:bootstrap]: Connect failed\n"
            "Writing model shards: 100%|##| 1/1 [00:00<00:00, 439.70it/s]\n\n")
    assert last_words(tail) == "rollstream learner: Kafka: KafkaError{code=NOT_COORDINATOR}"
    assert last_words("%3|noise only\n") is None


def test_a_child_gets_its_environment_where_the_inherited_one_does_not_set_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_TEST_SET", "inherited")
    monkeypatch.delenv("ROLLSTREAM_TEST_UNSET", raising=False)
    stack = Stack(tmp_path, max_restarts=0)
    stack.start(Child("learner", ("sh", "-c", 'echo "$ROLLSTREAM_TEST_SET $ROLLSTREAM_TEST_UNSET"'),
                      env={"ROLLSTREAM_TEST_SET": "child", "ROLLSTREAM_TEST_UNSET": "child"}))
    _wait_exit(stack)
    assert (tmp_path / "learner.log").read_text() == "inherited child\n"


def test_a_child_with_a_niceness_runs_that_much_nicer_than_us(tmp_path):
    stack = Stack(tmp_path, max_restarts=0)
    niced = stack.start(Child("learner", ("sleep", "30"), nice=3))
    plain = stack.start(Child("streams", ("sleep", "30")))
    try:
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, niced.process.pid) == min(19, ours + 3)
        assert os.getpriority(os.PRIO_PROCESS, plain.process.pid) == ours
    finally:
        for c in stack.children:
            c.process.kill()
        _wait_exit(stack)


def test_a_finished_process_that_exited_zero_is_left_alone(tmp_path):
    stack = Stack(tmp_path, max_restarts=0)
    stack.start(Child("learner", ("sh", "-c", "exit 0")))
    _wait_exit(stack)
    stack.supervise(lambda line: None, finished=("learner",))
    assert stack.restarts == {}


def test_without_restarts_the_first_death_ends_the_run(tmp_path):
    stack = Stack(tmp_path, max_restarts=0)
    stack.start(Child("dispatcher", ("sh", "-c", "echo boom; exit 1")))
    _wait_exit(stack)
    with pytest.raises(RunFailed, match="dispatcher exited with 1:\nboom"):
        stack.supervise(lambda line: None)


def test_the_restart_budget_counts_each_process_apart_and_refuses_past_its_limit():
    budget = RestartBudget(limit=2)
    assert [budget.take("learner", 1, lambda: ""), budget.take("run.current-0", -9, lambda: "")] == [1, 1]
    assert [budget.take("learner", 1, lambda: ""), budget.take("run.current-0", -9, lambda: "")] == [2, 2]
    with pytest.raises(RunFailed, match="^engine run.current-0 exited with -9 after 2 restarts:\nkilled$"):
        budget.take("run.current-0", -9, lambda: "killed", label="engine run.current-0")
    with pytest.raises(RunFailed, match="^learner exited with 1 after 2 restarts"):
        budget.take("learner", 1, lambda: "")
    assert budget.used == {"learner": 2, "run.current-0": 2}


def test_engines_and_children_share_the_stack_s_restart_record(tmp_path):
    stack = Stack(tmp_path, max_restarts=1)
    stack.budget.take("run.current-0", -9, lambda: "")
    assert stack.restarts == {"run.current-0": 1}


def test_the_stack_lists_where_each_process_serves_metrics_children_by_name_engines_by_id(tmp_path):
    stack = Stack(tmp_path)
    stack.start(with_metrics_port(Child("learner", ("sh", "-c", "exit 0")), 9101))
    stack.start(Child("helper", ("sh", "-c", "exit 0")))  # serves none
    stack.engines.append(EngineProcess("current", "r1.current-0", "http://127.0.0.1:8100", None, tmp_path / "e.log",
                                       metrics_port=9102))
    assert stack.metrics_urls() == {"learner": "http://127.0.0.1:9101/metrics",
                                    "r1.current-0": "http://127.0.0.1:9102/metrics"}
    _wait_exit(stack)


def test_a_second_signal_during_the_shutdown_is_ignored_instead_of_interrupting_it():
    previous = catch_interrupts()
    try:
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises before this ends
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, or `timeout` forwarding SIGTERM: no second raise
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_the_dispatcher_stops_first_the_streams_worker_last_and_the_rest_together_between():
    started = ["streams", "env-worker-0", "env-worker-1", "learner", "dispatcher"]
    assert stop_waves(started) == [["dispatcher"], ["learner", "env-worker-1", "env-worker-0"], ["streams"]]
    assert stop_waves(["streams", "learner"]) == [["learner"], ["streams"]]
    assert stop_waves([]) == []


def test_a_wave_stops_together_in_the_time_of_its_slowest_child_and_the_order_of_waves_holds(tmp_path):
    said: list[str] = []
    stack = Stack(tmp_path)
    order = tmp_path / "order"
    # Each child takes 2 s to stop after SIGTERM and writes its name when it is done.
    linger = 'trap "sleep 2; echo $0 >> {order}; exit 0" TERM; while :; do sleep 0.1; done'.format(order=order)
    for name in ("streams", "env-worker-0", "env-worker-1", "learner", "dispatcher"):
        stack.start(Child(name, ("sh", "-c", linger, name)))
    time.sleep(0.5)  # every trap is set
    began = time.monotonic()
    codes = stack.stop(said.append)
    took = time.monotonic() - began
    assert codes == {"dispatcher": 0, "learner": 0, "env-worker-1": 0, "env-worker-0": 0, "streams": 0}
    lines = order.read_text().split()
    assert lines[0] == "dispatcher" and lines[-1] == "streams"
    assert sorted(lines[1:4]) == ["env-worker-0", "env-worker-1", "learner"]
    assert 6 <= took < 9, took  # three waves of 2 s each, not five children one after another (10 s)
    assert said == ["stopped: dispatcher (ok), learner (ok), env-worker-1 (ok), env-worker-0 (ok), streams (ok)"]
