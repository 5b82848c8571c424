"""References to events (kafka://TOPIC/PARTITION/OFFSET): how the stream processor carries a
trajectory on without its token arrays, and how replay puts them back."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException
from helpers.events import trajectory

from pipeline.analysis.replay_records import ReplayRecord
from pipeline.analysis.replay_verify import verify, with_referred_arrays
from schemas import eventref, topics
from schemas.codec import codec
from streams.aggregator_agent import by_reference


def test_a_reference_names_topic_partition_and_offset_and_parses_back():
    ref = eventref.uri("trajectories", 3, 7081)
    assert ref == "kafka://trajectories/3/7081"
    assert eventref.parse(ref) == ("trajectories", 3, 7081)
    assert eventref.is_ref(ref) and not eventref.is_ref("s3://payloads/k.npz") and not eventref.is_ref(None)


@pytest.mark.parametrize("bad", ["s3://b/k", "kafka://trajectories/3", "kafka://trajectories/x/1",
                                 "kafka:///3/1", "kafka://trajectories/3/-1", "kafka://t/1/2/3"])
def test_anything_but_topic_partition_offset_is_refused(bad):
    with pytest.raises(ValueError, match="not a kafka://TOPIC/PARTITION/OFFSET reference"):
        eventref.parse(bad)


def test_offsets_close_together_are_read_as_one_range():
    assert eventref.ranges([9, 1, 3, 3, 2], max_gap=2) == [(1, 3), (9, 9)]
    assert eventref.ranges([1, 300, 600], max_gap=256) == [(1, 1), (300, 300), (600, 600)]
    assert eventref.ranges([], max_gap=1) == []


@pytest.mark.parametrize("code", [KafkaError._UNKNOWN_PARTITION, KafkaError._TRANSPORT, KafkaError._TIMED_OUT,
                                  KafkaError._ALL_BROKERS_DOWN, KafkaError.LEADER_NOT_AVAILABLE,
                                  KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.REQUEST_TIMED_OUT])
def test_what_a_broker_restart_raises_is_retried(code):
    assert eventref.should_retry(code)
    assert not eventref.should_retry(code, fatal=True)


@pytest.mark.parametrize("code", [KafkaError.OFFSET_OUT_OF_RANGE, KafkaError.MSG_SIZE_TOO_LARGE,
                                  KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._INVALID_ARG])
def test_errors_a_retry_cannot_cure_are_raised_unless_librdkafka_calls_them_retriable(code):
    assert not eventref.should_retry(code)
    assert eventref.should_retry(code, retriable=True)


def test_backoff_doubles_from_a_quarter_second_up_to_five():
    assert [eventref.backoff_s(n) for n in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def _transient() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, "Local: Unknown partition"))


def test_a_call_failing_transiently_is_retried_until_it_succeeds():
    now, outcomes = [0.0], [_transient(), _transient(), "read"]

    def call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def sleep(s: float) -> None:
        now[0] += s

    assert eventref.retrying(call, "reading", 10.0, clock=lambda: now[0], sleep=sleep) == "read"
    assert now[0] == 0.75


def test_a_broker_down_past_the_outage_deadline_raises_a_clear_error():
    now, waits = [0.0], []

    def call() -> None:
        raise _transient()

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    with pytest.raises(eventref.BrokerUnavailable, match=r"reading x: Kafka failed transiently for 2\d s .*Unknown "
                                                          r"partition.*after 20 s"):
        eventref.retrying(call, "reading x", 20.0, clock=lambda: now[0], sleep=sleep)
    assert sum(waits) >= 20.0 and max(waits) == 5.0


def test_an_error_that_is_not_transient_is_raised_at_once():
    calls = []

    def call() -> None:
        calls.append(1)
        raise KafkaException(KafkaError(KafkaError.OFFSET_OUT_OF_RANGE, "Broker: Offset out of range"))

    with pytest.raises(KafkaException):
        eventref.retrying(call, "reading", 60.0, sleep=lambda s: None)
    assert len(calls) == 1


def test_the_aggregator_carries_a_trajectory_on_without_its_arrays_referring_to_its_event():
    t = trajectory("r", "g", 0, 2, 1.0, num_tokens=2048)
    data = codec().encode("trajectory", t)
    carried = codec().decode(by_reference(t, data, "trajectories", 5, 42), "trajectory")
    assert carried["arrays_uri"] == "kafka://trajectories/5/42"
    assert (carried["input_ids"], carried["loss_mask"], carried["rollout_logprobs"]) == (b"", b"", b"")
    assert {k: v for k, v in carried.items() if k not in ("input_ids", "loss_mask", "rollout_logprobs", "arrays_uri")} \
        == {k: v for k, v in t.items() if k not in ("input_ids", "loss_mask", "rollout_logprobs", "arrays_uri")}
    assert len(by_reference(t, data, "trajectories", 5, 42)) < len(data) / 10


def test_a_trajectory_whose_arrays_are_in_the_object_store_goes_on_as_it_came():
    t = {**trajectory("r", "g", 0, 2, 1.0), "input_ids": b"", "loss_mask": b"", "rollout_logprobs": b"",
         "arrays_uri": "s3://payloads/r/t.npz"}
    data = codec().encode("trajectory", t)
    assert by_reference(t, data, "trajectories", 0, 1) is data


def _group(run: str, members: list[dict]) -> dict:
    return {"group_id": members[0]["group_id"], "run": run, "task": "db", "split": "dev", "sample_index": 0,
            "group_size": len(members), "validation": False, "completion": "complete",
            "members": [{"trajectory": t, "advantage": a, "masked": False} for t, a in zip(members, (0.707107, -0.707107))],
            "reward_mean": 0.5, "reward_std": 0.707107, "all_equal": False, "min_weight_version": 0,
            "first_arrival_ms": 0, "last_arrival_ms": 0, "ready_at_ms": 0}


def _verify_groups(trajectories: list[dict], carried: list[dict]) -> dict:
    records = {topics.TRAJECTORIES: [ReplayRecord(topics.TRAJECTORIES, 0, 10 + i, 0, None, t)
                                     for i, t in enumerate(trajectories)],
               topics.GROUPS: [ReplayRecord(topics.GROUPS, 0, 0, 0, None, _group("r", carried))]}
    report = verify(records, run="r")
    return {c.name: c for c in report.checks} | {"not_checked": report.not_checked}


def test_verify_compares_members_with_the_arrays_of_the_events_they_refer_to():
    ts = [trajectory("r", "r-g", m, 2, float(1 - m), num_tokens=16) for m in range(2)]
    carried = [{**t, "input_ids": b"", "loss_mask": b"", "rollout_logprobs": b"",
                "arrays_uri": eventref.uri(topics.TRAJECTORIES, 0, 10 + i)} for i, t in enumerate(ts)]
    same = _verify_groups(ts, carried)["group_members_match_trajectories"]
    assert (same.checked, same.mismatches) == (2, [])

    crossed = [{**carried[0], "arrays_uri": carried[1]["arrays_uri"]}, carried[1]]
    same = _verify_groups(ts, crossed)["group_members_match_trajectories"]
    assert [m.detail for m in same.mismatches] == [f"arrays_uri {carried[1]['arrays_uri']} is an event of trajectory "
                                                     f"{ts[1]['trajectory_id']}"]


def test_a_member_referring_to_an_event_outside_the_replay_is_counted_not_checked():
    t = trajectory("r", "r-g", 0, 2, 1.0, num_tokens=16)
    carried = {**t, "input_ids": b"", "arrays_uri": eventref.uri(topics.TRAJECTORIES, 0, 999)}
    assert with_referred_arrays(carried, {}) is None
    inline = trajectory("r", "r-g", 1, 2, 0.0, num_tokens=16)
    assert with_referred_arrays(inline, {}) is inline
    result = _verify_groups([t], [carried, inline])
    assert result["not_checked"]["members_referring_to_events_not_replayed"] == 1
