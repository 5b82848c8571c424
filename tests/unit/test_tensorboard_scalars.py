"""The TensorBoard scalars of a run's `metrics` events (pipeline/analysis/tensorboard_scalars.py); the command
that writes them from Kafka is checked in tests/integration/test_tensorboard.py."""

from __future__ import annotations

from pipeline.analysis.tensorboard_scalars import RunState, Scalar, in_time_order, scalars, tag_of
from schemas.codec import codec


def _metric(name: str, value: float, step: int | None, at_ms: int, source: str = "learner", **labels: str) -> dict:
    event = {"run": "r", "name": name, "value": value, "step": step, "labels": labels, "source": source,
             "at_ms": at_ms}
    return codec().decode(codec().encode("metric", event), "metric")  # as a reader of the topic gets it


def _all(events: list[dict]) -> list[Scalar]:
    state = RunState()
    return [s for e in events for s in scalars(e, state)]


def test_a_learner_metric_is_one_scalar_at_its_own_step_and_time():
    assert _all([_metric("actor/pg_loss", 0.5, 3, 1_700_000_000_250)]) == [
        Scalar("actor/pg_loss", 0.5, 3, 1_700_000_000.25)]


def test_labels_join_the_tag_in_key_order_with_only_characters_a_tag_can_hold():
    assert tag_of("streams/success_rate", {"worker": "rollstream-streams.r1", "task": "db"}) == \
        "streams/success_rate/task_db/worker_rollstream-streams.r1"
    assert tag_of("streams/group_latency_first_ms_count", {"bucket": "<=1024"}) == \
        "streams/group_latency_first_ms_count/bucket___1024"


def test_a_metric_without_a_step_takes_the_newest_learner_step_measured_before_it():
    events = [_metric("streams/success_rate", 0.1, None, 100, "streams/metrics", task="db"),
              _metric("actor/loss", 1.0, 1, 200),
              _metric("streams/success_rate", 0.2, None, 300, "streams/metrics", task="db"),
              _metric("actor/loss", 0.5, 2, 400),
              _metric("streams/success_rate", 0.3, None, 500, "streams/metrics", task="db")]
    success = [(s.step, s.value) for s in _all(events) if s.tag == "streams/success_rate/task_db"]
    assert success == [(0, 0.1), (1, 0.2), (2, 0.3)]


def test_a_step_that_is_not_the_learners_does_not_move_the_learner_step():
    # the aggregator stamps a dropped group with the learner version it knew, which may run ahead
    events = [_metric("actor/loss", 1.0, 1, 100),
              _metric("streams/group_dropped", 1.0, 7, 200, "streams/aggregator", group_id="g1", reason="stale"),
              _metric("streams/success_rate", 0.5, None, 300, "streams/metrics", task="db")]
    assert [s.step for s in _all(events)] == [1, 7, 1]


def test_events_that_name_one_item_are_counted_per_name_task_and_reason():
    events = [_metric("streams/group_dropped", 1.0, 1, 100, "streams/aggregator", group_id="g1", reason="timeout",
                      task="db"),
              _metric("streams/group_dropped", 1.0, 2, 200, "streams/aggregator", group_id="g2", reason="timeout",
                      task="db"),
              _metric("streams/group_dropped", 1.0, 2, 300, "streams/aggregator", group_id="g3", reason="stale",
                      task="db"),
              _metric("learner/batch_skipped", 1.0, 2, 400, batch_id="b9")]
    assert [(s.tag, s.value) for s in _all(events)] == [
        ("streams/group_dropped/reason_timeout/task_db", 1.0), ("streams/group_dropped/reason_timeout/task_db", 2.0),
        ("streams/group_dropped/reason_stale/task_db", 1.0), ("learner/batch_skipped", 1.0)]


def test_a_value_that_is_not_finite_is_left_out():
    assert _all([_metric("actor/kl_loss", float("nan"), 1, 100), _metric("actor/kl_loss", float("inf"), 2, 200)]) == []


def test_a_history_read_partition_after_partition_is_put_back_in_the_order_measured():
    partition_0 = [_metric("streams/success_rate", 0.2, None, 300, "streams/metrics", task="db")]
    partition_1 = [_metric("actor/loss", 1.0, 1, 200), _metric("actor/loss", 0.5, 2, 400)]
    ordered = in_time_order(partition_0 + partition_1)
    assert [e["at_ms"] for e in ordered] == [200, 300, 400]
    assert [s.step for s in _all(ordered) if s.tag.startswith("streams/")] == [1]
