"""The streams jobs' per-event handlers with plain dicts standing in for their Faust tables, the
table codec, the App factory and the CLI user errors. No broker: the Faust glue around these
handlers runs against the real one in tests/integration/test_streams_*.py."""

from __future__ import annotations

import asyncio
import json
import ssl

import faust
import numpy as np
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from helpers.events import trajectory, weights
from typer.testing import CliRunner

from pipeline.cli import dispatch as dispatch_cmd

from pipeline.cli import streams as streams_cmd
from schemas import objectstore, samples, topics
from schemas.codec import codec
from schemas.settings import KafkaSettings, ObjectStoreSettings
from streams import aggregator_agent as agg
from streams import batcher_state as bat
from streams import behaviour
from streams import metrics_agent as met
from streams import router_agent as rt
from streams import routing
from streams.advantages import grpo_advantages
from streams.app import Wiring, create_app, create_wiring, newest_by_key
from streams.broker import RECORD_OVERHEAD_BYTES, broker_credentials
from streams.producer_buffer import drain_before_commit
from streams.serde import TaggedJSON
from streams.settings import StreamsSettings, WorkerSettings

N = 4
S = StreamsSettings(group_size=N, batch_size=1, first_batch_factor=1.0, min_members=2, group_timeout_s=10)
T0 = 1_000_000


def _tables() -> agg.AggregatorTables:
    return agg.AggregatorTables({}, {})


def _encoded(gid: str, member: int, reward: float, **kw) -> bytes:
    return codec().encode("trajectory", trajectory("r", gid, member, N, reward, num_tokens=8 + member, **kw))


def _offer(tables: agg.AggregatorTables, data: bytes, partition: int, now_ms: int, settings: StreamsSettings):
    """What the aggregator agent does with a `trajectories` event (at offset 1000 + member)."""
    t = codec().decode(data, "trajectory")
    return agg.on_trajectory(tables, agg.carried(t, topics.TRAJECTORIES, partition, 1000 + t["member"]), partition,
                             now_ms, settings)


def _decode_outs(outs):
    return [(topic, codec().decode(value, topics.EVENT_OF_TOPIC[topic])) for topic, _, value in outs]


def test_group_is_emitted_with_its_members_referring_to_their_events_and_the_state_frees_them():
    tables = _tables()
    rewards = [1.0, 0.0, 0.5, 1.0]
    sent = [_encoded("g", m, r) for m, r in enumerate(rewards)]
    outs = [_offer(tables, data, 0, T0 + m, S) for m, data in enumerate(sent)]
    assert outs[:3] == [[], [], []]
    [(topic, group)] = _decode_outs(outs[3])
    assert topic == topics.GROUPS and group["completion"] == "complete"
    np.testing.assert_allclose([m["advantage"] for m in group["members"]], grpo_advantages(rewards, ["g"] * N))
    assert [m["trajectory"] for m in group["members"]] == [
        agg.carried(codec().decode(data, "trajectory"), topics.TRAJECTORIES, 0, 1000 + m) for m, data in enumerate(sent)]
    assert [m["trajectory"]["arrays_uri"] for m in group["members"]] == [
        f"kafka://trajectories/0/{1000 + m}" for m in range(N)]
    assert tables.groups["g"]["members"] == {}
    assert tables.groups["g"]["closed"] == "emitted" and tables.groups["g"]["partition"] == 0


def test_group_state_keeps_no_token_arrays():
    tables = _tables()
    _offer(tables, _encoded("g", 0, 1.0), 0, T0, S)
    member = tables.groups["g"]["members"]["0"]
    assert (member["input_ids"], member["loss_mask"], member["rollout_logprobs"]) == (b"", b"", b"")
    assert member["arrays_uri"] == "kafka://trajectories/0/1000"


def test_duplicate_member_is_dropped_and_counted():
    tables = _tables()
    _offer(tables, _encoded("g", 0, 1.0), 1, T0, S)
    assert _offer(tables, _encoded("g", 0, 1.0), 1, T0 + 5, S) == []
    assert tables.groups["g"]["arrivals"] == {"0": T0}
    assert tables.partitions["p1"]["stats"]["r"]["counters"] == {"duplicates": 1}


def test_tick_closes_only_its_own_partitions_timed_out_groups():
    tables = _tables()
    for m in range(3):
        _offer(tables, _encoded("a", m, float(m)), 0, T0, S)
        _offer(tables, _encoded("b", m, float(m)), 1, T0, S)
    assert agg.on_tick(tables, 0, T0 + 9_999, S) == []
    [(topic, group)] = _decode_outs(agg.on_tick(tables, 0, T0 + 10_000, S))
    assert (topic, group["group_id"], group["completion"]) == (topics.GROUPS, "a", "timeout")
    assert tables.groups["b"]["closed"] is None


def test_group_with_too_few_members_is_reported_as_dropped_metric():
    tables = _tables()
    _offer(tables, _encoded("g", 0, 1.0), 0, T0, S)
    [(topic, metric)] = _decode_outs(agg.on_tick(tables, 0, T0 + 10_000, S))
    assert (topic, metric["name"], metric["labels"]["group_id"], metric["labels"]["reason"]) == \
        (topics.METRICS, "streams/group_dropped", "g", "too_few_members")
    assert tables.groups["g"]["members"] == {}


def test_group_behind_the_learner_by_more_than_max_staleness_is_dropped():
    tables = _tables()
    agg.on_weights(tables, codec().encode("weight_version", weights("r", 100)), 0)
    [(_, metric)] = _decode_outs(_offer(tables, _encoded("g", 0, 1.0, version=10), 0, T0, S))
    assert metric["labels"]["reason"] == "stale"


def test_the_aggregators_gauges_count_open_groups_and_add_up_the_closed_ones_over_partitions():
    tables = _tables()
    agg.on_weights(tables, codec().encode("weight_version", weights("r", 3)), 0)
    for m in range(N):  # complete on partition 0, its turns one version behind the learner
        _offer(tables, _encoded("a", m, float(m), version=2), 0, T0, S)
    for m in range(2):  # waiting on partitions 1 and 2
        _offer(tables, _encoded("b", m, float(m)), 1, T0, S)
        _offer(tables, _encoded("c", m, float(m)), 2, T0, S)
    _offer(tables, _encoded("c", 0, 0.0), 2, T0, S)  # a duplicate
    state = agg.local_state(tables)["r"]
    assert state["open"] == 2
    assert (state["counters"]["emitted"], state["counters"]["duplicates"]) == (1, 1)
    assert state["staleness"] == {"1": 1}


def test_expired_tombstones_are_deleted_by_the_sweep():
    tables = _tables()
    for m in range(N):
        _offer(tables, _encoded("g", m, float(m)), 0, T0, S)
    agg.on_tick(tables, 0, T0 + int(S.closed_retention_s * 1000), S)
    assert "g" not in tables.groups


def _group(gid: str, run: str = "r", members: int = N) -> bytes:
    g = {**samples.group(), "group_id": gid, "run": run, "group_size": members,
         "members": [{"trajectory": {**samples.trajectory(m), "group_id": gid, "run": run}, "advantage": float(m),
                      "masked": False} for m in range(members)]}
    return codec().encode("group", g)


def _batcher(tables, data, claim=None):
    outs, uploads = bat.on_batcher_event(tables, data, T0, S, claim)
    return outs


def test_first_batch_needs_no_credit_and_the_next_waits_for_a_newer_version():
    tables = bat.BatcherTables({}, {}, {})
    [(topic, first)] = _decode_outs(_batcher(tables, _group("g0")))
    assert (topic, first["index"], first["credit_version"], first["group_ids"]) == (topics.BATCHES, 0, 0, ["g0"])
    assert _batcher(tables, _group("g1")) == []
    assert _batcher(tables, codec().encode("weight_version", weights("r", 0))) == []
    [(_, second)] = _decode_outs(_batcher(tables, codec().encode("weight_version", weights("r", 1))))
    assert (second["index"], second["credit_version"], second["group_ids"]) == (1, 1, ["g1"])
    assert tables.ready == {} and tables.batched == {"g0": {"batch_id": first["batch_id"], "at_ms": T0},
                                                     "g1": {"batch_id": second["batch_id"], "at_ms": T0}}


def test_redelivered_group_is_batched_once():
    tables = bat.BatcherTables({}, {}, {})
    _batcher(tables, _group("g0"))
    _batcher(tables, codec().encode("weight_version", weights("r", 1)))
    assert _batcher(tables, _group("g0")) == []
    assert (tables.state["r"]["available"], tables.queue, tables.ready) == (0, {}, {})


def test_a_batched_group_is_remembered_for_the_closed_retention_then_forgotten_at_a_cut():
    hour_ms = int(S.closed_retention_s * 1000)
    tables = bat.BatcherTables({}, {}, {})
    bat.on_batcher_event(tables, _group("g0"), T0, S)
    bat.on_batcher_event(tables, codec().encode("weight_version", weights("r", 1)), T0, S)
    assert bat.on_batcher_event(tables, _group("g0"), T0 + hour_ms - 1, S) == ([], [])  # a redelivery: dropped
    [(_, batch)] = _decode_outs(bat.on_batcher_event(tables, _group("g1"), T0 + hour_ms, S)[0])
    assert batch["group_ids"] == ["g1"] and list(tables.batched) == ["g1"]


def test_groups_are_batched_in_arrival_order_not_by_id():
    tables = bat.BatcherTables({}, {}, {})
    _batcher(tables, _group("g0"))
    for gid in ("g9", "g1", "g5"):
        assert _batcher(tables, _group(gid)) == []  # no credit after the first batch
    [(_, batch)] = _decode_outs(_batcher(tables, codec().encode("weight_version", weights("r", 1))))
    assert batch["group_ids"] == ["g9", "g1", "g5"]


class _ChangelogBytes(dict):
    """A table that keeps the size of every value written, encoded as its changelog carries it."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __setitem__(self, key, value) -> None:
        self.sizes.append(len(TaggedJSON()._dumps(value)))
        super().__setitem__(key, value)


def test_a_waiting_group_rewrites_a_fixed_size_run_state_however_many_groups_are_ready():
    tables = bat.BatcherTables(_ChangelogBytes(), {}, {})
    waiting = StreamsSettings(group_size=N, batch_size=1000, min_members=2)
    for g in range(200):
        bat.on_batcher_event(tables, _group(f"g{g}"), T0, waiting)
    assert len(tables.ready) == len(tables.queue) == 200 and tables.state["r"]["available"] == 200 * N
    assert max(tables.state.sizes) - min(tables.state.sizes) <= 4  # the digits of two counters


def test_a_cut_changes_the_tables_only_once_applied():
    direct = bat.BatcherTables({}, {}, {})
    _batcher(direct, _group("g0"))
    tables = bat.BatcherTables({}, {}, {})
    view = bat.staged(tables)
    outs, _ = bat.on_batcher_event(view, _group("g0"), T0, S)
    # until applied (after the batch is sent) the tables are untouched: a failed send loses nothing
    assert len(outs) == 1 and tables.all() == ({}, {}, {}, {})
    assert dict(view.batched) == direct.batched and dict(view.ready) == {} and dict(view.queue) == {}
    bat.apply(view)
    assert tables.all() == direct.all()


def test_batch_above_the_limit_becomes_a_claim_check_that_resolves_to_the_inline_batch():
    inline = bat.on_batcher_event(bat.BatcherTables({}, {}, {}), _group("g0"), T0, S)
    [(_, whole)] = _decode_outs(inline[0])
    size = len(inline[0][0][2])
    [out], [(bucket, key, data)] = bat.on_batcher_event(bat.BatcherTables({}, {}, {}), _group("g0"), T0, S,
                                                        bat.ClaimCheck("payloads", size - 1))
    pointer = codec().decode(out[2], "batch")
    assert (bucket, key, data) == ("payloads", f"r/batches/{whole['batch_id']}.avro", inline[0][0][2])
    assert pointer["items"] == [] and pointer["payload_uri"] == f"s3://payloads/{key}"
    assert pointer["payload_bytes"] == size and len(out[2]) < size
    assert objectstore.resolve_claim_check(pointer, "batch", {pointer["payload_uri"]: data}.__getitem__) == \
        {**whole, **{k: pointer[k] for k in objectstore.PAYLOAD_FIELDS}}
    # at the limit it stays inline
    [at_limit], uploads = bat.on_batcher_event(bat.BatcherTables({}, {}, {}), _group("g0"), T0, S,
                                               bat.ClaimCheck("payloads", size))
    assert uploads == [] and codec().decode(at_limit[2], "batch") == whole


def test_failed_store_backoff_doubles_per_failure_up_to_its_cap():
    w = WorkerSettings(store_backoff_s=5, store_backoff_max_s=300)
    assert [bat.store_retry_at(n, T0, w) - T0 for n in (1, 2, 3, 7, 1000)] == [5000, 10000, 20000, 300000, 300000]
    assert bat.store_due({"retry_at_ms": T0 + 5000}, T0 + 4999) is False
    assert bat.store_due({"retry_at_ms": T0 + 5000}, T0 + 5000) is True
    assert bat.store_due(bat.empty_state(), T0) is True


def _fail_store(tables, data, pointer, now_ms, reason="MaxRetryError: connection refused"):
    view = bat.staged(tables)
    outs = bat.on_store_failure(view, data, pointer, now_ms, WorkerSettings(), reason)
    bat.apply(view)
    return outs


def test_batch_whose_store_failed_keeps_its_groups_ready_and_is_cut_again_after_the_backoff():
    claim = bat.ClaimCheck("payloads", 1)  # every batch is claim-checked
    tables = bat.BatcherTables({}, {}, {})
    data = _group("g0")
    [failed], [_] = bat.on_batcher_event(bat.staged(tables), data, T0, S, claim)
    [(topic, metric)] = _decode_outs(_fail_store(tables, data, failed[2], T0))
    failed_batch = codec().decode(failed[2], "batch")
    assert (topic, metric["name"], metric["value"]) == (topics.METRICS, bat.STORE_FAILED_METRIC, 1.0)
    assert metric["labels"] == {"batch_id": failed_batch["batch_id"], "index": "0", "consecutive_failures": "1",
                                "retry_in_s": "5", "reason": "MaxRetryError: connection refused"}
    assert (list(tables.ready), tables.batched) == (["g0"], {})
    state = tables.state["r"]
    assert (state["index"], state["answered"], state["store_failures"], state["retry_at_ms"]) == (0, None, 1, T0 + 5000)
    # nothing is cut while the backoff runs, whatever arrives
    assert bat.on_batcher_event(tables, bat.TICK, T0 + 4999, S, claim) == ([], [])
    assert bat.on_batcher_event(tables, codec().encode("weight_version", weights("r", 0)), T0 + 4999, S, claim) == \
        ([], [])
    # then a tick cuts the same groups again: the same batch id, sent once it is stored
    view = bat.staged(tables)
    [retried], [(_, key, _)] = bat.on_batcher_event(view, bat.TICK, T0 + 5000, S, claim)
    again = codec().decode(retried[2], "batch")
    assert (again["batch_id"], again["index"], again["group_ids"]) == (failed_batch["batch_id"], 0, ["g0"])
    assert key == bat.payload_key("r", again["batch_id"])
    bat.apply(view)
    assert (tables.state["r"]["store_failures"], tables.state["r"]["retry_at_ms"]) == (0, None)
    assert tables.batched == {"g0": {"batch_id": again["batch_id"], "at_ms": T0 + 5000}}
    assert bat.on_batcher_event(tables, bat.TICK, T0 + 9999, S, claim) == ([], [])


def test_repeated_store_failures_back_off_longer_and_groups_arriving_meanwhile_wait():
    claim = bat.ClaimCheck("payloads", 1)
    tables = bat.BatcherTables({}, {}, {})
    [first], _ = bat.on_batcher_event(bat.staged(tables), _group("g0"), T0, S, claim)
    _fail_store(tables, _group("g0"), first[2], T0)
    assert bat.on_batcher_event(tables, _group("g1"), T0 + 1000, S, claim) == ([], [])
    [second], _ = bat.on_batcher_event(bat.staged(tables), bat.TICK, T0 + 5000, S, claim)
    assert codec().decode(second[2], "batch")["group_ids"] == ["g0", "g1"]  # every ready group, as any cut
    [(_, metric)] = _decode_outs(_fail_store(tables, bat.TICK, second[2], T0 + 5000))
    assert metric["labels"]["consecutive_failures"] == "2" and tables.state["r"]["retry_at_ms"] == T0 + 15000
    assert sorted(tables.ready) == ["g0", "g1"] and tables.state["r"]["index"] == 0


def test_claim_check_whose_object_differs_is_refused():
    whole = samples.batch()
    data = codec().encode("batch", whole)
    pointer = objectstore.claim_check(whole, "s3://p/k", data, {"items": []})
    with pytest.raises(objectstore.PayloadMismatch, match="sha256"):
        objectstore.resolve_claim_check(pointer, "batch", lambda uri: data[:-1] + bytes([data[-1] ^ 1]))
    other = codec().encode("batch", {**whole, "index": 9})
    forged = objectstore.claim_check(whole, "s3://p/k", other, {"items": []})
    with pytest.raises(objectstore.PayloadMismatch, match="index"):
        objectstore.resolve_claim_check(forged, "batch", lambda uri: other)
    assert objectstore.resolve_claim_check(whole, "batch", lambda uri: b"") == whole


def test_batch_offload_limit_stays_under_the_kafka_message_limit():
    app_kafka = KafkaSettings(message_max_bytes=1024 * 1024)
    wiring = Wiring(None, app_kafka, S, WorkerSettings(), lambda: T0, {}, {}, ObjectStoreSettings())
    assert wiring.batch_limit_bytes == 1024 * 1024 - RECORD_OVERHEAD_BYTES
    small = Wiring(None, KafkaSettings(), S, WorkerSettings(batch_offload_bytes=1000), lambda: T0, {}, {},
                   ObjectStoreSettings())
    assert small.batch_limit_bytes == 1000


def test_sasl_settings_become_faust_broker_credentials():
    assert broker_credentials(KafkaSettings()) is None
    sasl = broker_credentials(KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                                            sasl_username="u", sasl_password="p"))
    assert isinstance(sasl, faust.SASLCredentials)
    assert credentials_to_aiokafka_auth(sasl) == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
        "sasl_plain_password": "p", "ssl_context": None}
    over_tls = credentials_to_aiokafka_auth(broker_credentials(KafkaSettings(
        security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")))
    assert (over_tls["security_protocol"], over_tls["sasl_mechanism"]) == ("SASL_SSL", "PLAIN")
    assert isinstance(over_tls["ssl_context"], ssl.SSLContext)
    assert credentials_to_aiokafka_auth(broker_credentials(KafkaSettings(security_protocol="SSL")))[
        "security_protocol"] == "SSL"
    app = create_app(KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                                   sasl_password="p"), S, WorkerSettings(app_id="unit", web_enabled=False), ["batcher"])
    assert app.conf.broker_credentials.username == "u"


def test_sasl_without_a_supported_mechanism_is_refused():
    with pytest.raises(ValueError, match="sasl_mechanism"):
        broker_credentials(KafkaSettings(security_protocol="SASL_SSL"))
    with pytest.raises(ValueError, match="security_protocol"):
        broker_credentials(KafkaSettings(security_protocol="KERBEROS"))


def test_router_plans_from_the_folded_heartbeats_and_learner_version():
    table: dict = {}
    hb = {**samples.engine_heartbeat(), "engine_id": "s0", "pool": "stale", "loaded_version": 0, "sent_at_ms": T0}
    assert rt.on_router_event(table, codec().encode("engine_heartbeat", hb), 3, T0, S) == []
    rt.on_router_event(table, codec().encode("weight_version", weights("example", 7)), 3, T0, S)
    request = samples.task_requested(2)
    [(topic, task)] = _decode_outs(rt.on_router_event(table, codec().encode("task_requested", request), 3, T0 + 1, S))
    plan = routing.plan_turn_pools("example", request["group_id"], 2, S.max_turns, S.stale_ratio,
                                   routing.PoolState(("s0",), 0), False, S.max_stale_lag, learner_version=7,
                                   stale_step=S.stale_step)
    assert (topic, task["turn_pools"], task["routing_reason"]) == (topics.TASKS, plan.turn_pools, "mixed")
    # the same request routed on another partition, whose registry is empty, goes current-only
    [(_, other)] = _decode_outs(rt.on_router_event(table, codec().encode("task_requested", request), 4, T0, S))
    assert other["routing_reason"] == routing.REASON_NO_STALE_ENGINE


def _route(settings: StreamsSettings, member: int) -> dict:
    table: dict = {}
    hb = {**samples.engine_heartbeat(), "engine_id": "s0", "pool": "stale", "loaded_version": 0, "sent_at_ms": T0}
    rt.on_router_event(table, codec().encode("engine_heartbeat", hb), 0, T0, settings)
    request = {**samples.task_requested(member), "group_id": f"g{member}"}
    [(_, task)] = _decode_outs(rt.on_router_event(table, codec().encode("task_requested", request), 0, T0, settings))
    return task


def test_the_router_follows_the_routing_mode_and_stale_ratio_of_its_settings():
    trajectory_level = S.model_copy(update={"routing_mode": "trajectory"})
    plans = [_route(trajectory_level, m)["turn_pools"] for m in range(40)]
    assert all(len(set(pools)) == 1 for pools in plans) and {p[0] for p in plans} == {"current", "stale"}
    assert any(len(set(_route(S, m)["turn_pools"])) == 2 for m in range(40))
    no_stale = S.model_copy(update={"stale_ratio": 0.0})
    assert {pool for m in range(40) for pool in _route(no_stale, m)["turn_pools"]} == {"current"}


def test_table_codec_round_trips_bytes_inside_nested_values():
    value = {"members": {"0": {"input_ids": b"\x00\xff", "turns": [{"n": 1}]}}, "closed": None,
             "empty": b"", "reward": 0.1, "pair": ["a", 2]}
    codec_ = TaggedJSON()
    assert codec_.loads(codec_.dumps(value)) == value
    assert codec_.loads(codec_.dumps({1: (b"x", 2)})) == {"1": [b"x", 2]}  # as the standard library writes them


def test_metrics_summary_has_the_per_task_figures():
    row = None
    for m, status in enumerate(["completed", "completed", "task_error", "task_limit_reached"]):
        t = trajectory("r", "g", m, N, 1.0 if m == 0 else 0.0, status=status, num_tokens=16)
        t.update(score=None, env_reward=t["reward"], finished_at_ms=T0 + 1000 * m)
        row = met.count_event(row, met.TRAJECTORY, t)
    step = samples.step()
    row = met.count_event(row, met.STEP, {**step, "pool": "stale"})
    row = met.count_event(row, met.STEP, step)
    summary = met.summarize([("r|db|0", row)], [{"r": {"counters": {"emitted": 3, "dropped": 1}, "latency_ms": {},
                                                       "staleness": {"2": 3}}}])
    task = summary["r"]["tasks"]["db"]
    assert (task["trajectories"], task["success_rate"], task["mean_reward"], task["stale_turn_share"]) == (4, 0.25, 0.25, 0.5)
    assert task["status_shares"] == {"completed": 0.5, "task_error": 0.25, "task_limit_reached": 0.25}
    assert (task["tokens_per_trajectory"], task["trajectories_per_s"]) == (16, 4 / 3)
    assert summary["r"]["groups"]["dropped_share"] == 0.25
    names = {e["name"] for e in met.metric_events(summary, "w", T0)}
    assert {"streams/success_rate", "streams/stale_turn_share", "streams/status_share", "streams/dropped_share",
            "streams/staleness_count"} <= names


def test_metrics_summary_has_the_per_task_behaviour_figures_and_publishes_them():
    row = None
    ls, rm = ({"name": "bash_action", "arguments_json": json.dumps({"script": s})} for s in ("ls", "rm -rf /"))
    for step in ({**samples.step(), "tool_calls": [ls, rm], "finish_reason": "length"},
                 {**samples.step(), "tool_calls": [ls], "env_status": "task_error"},
                 {**samples.step(), "tool_calls": [], "parse_error": "no closing tag"},
                 samples.step()):  # execute_sql, stop, running
        row = met.count_event(row, met.STEP, step)
    t = trajectory("r", "g", 0, N, 1.0, num_tokens=16)
    t.update(score=None, metrics={"parsed_calls": 3.0, "repeated_calls": 1.0, "dangerous_calls": 1.0,
                                  "dangerous_calls:recursive_delete": 1.0, "tool_calls": 3.0, "tool_errors": 0.0})
    row = met.count_event(row, met.TRAJECTORY, t)
    assert not [k for k, v in row.items() if isinstance(v, (dict, list))]  # counters only
    summary = met.summarize([("r|db|0", row), ("r|db|1", met.count_event(None, met.STEP, samples.step()))], [])
    b = summary["r"]["tasks"]["db"]["behaviour"]
    assert (b["steps"], b["invalid_output_share"], b["truncation_share"]) == (5, 0.2, 0.2)
    assert b["response_tokens_per_step"] == 3.0
    assert b["mean_token_nll"] == pytest.approx(1.875 / 3)
    assert b["tools"] == {"bash_action": {"calls": 3, "success_rate": 2 / 3},
                          "execute_sql": {"calls": 2, "success_rate": 1.0}}
    assert (b["calls"], b["call_success_rate"], b["tool_error_share"]) == (5, 0.8, 0.0)
    assert (b["repeated_call_share"], b["dangerous_calls"]) == (1 / 3, 1)
    assert b["dangerous_by_pattern"] == {"recursive_delete": 1}
    assert summary["r"]["tasks"]["db"]["steps"] == 5  # the existing figures are untouched
    events = {(e["name"], tuple(sorted((k, v) for k, v in e["labels"].items() if k != "worker"))): e["value"]
              for e in met.metric_events(summary, "w", T0)}
    assert events[("streams/truncation_share", (("task", "db"),))] == 0.2
    assert events[("streams/dangerous_calls", (("task", "db"),))] == 1.0
    assert events[("streams/tool_success_rate", (("task", "db"), ("tool", "bash_action")))] == pytest.approx(2 / 3)
    assert events[("streams/tool_calls", (("task", "db"), ("tool", "execute_sql")))] == 2.0
    assert events[("streams/dangerous_calls_by_pattern", (("pattern", "recursive_delete"), ("task", "db")))] == 1.0
    assert {f"streams/{figure}" for figure in behaviour.FIGURES} <= {name for name, _ in events}


def test_create_app_declares_only_the_chosen_jobs():
    app = create_app(KafkaSettings(), S, WorkerSettings(app_id="unit", web_enabled=False), ["batcher"])
    assert set(app.agents) == {"batcher-intake", "batcher-weights-intake", "batcher"}
    with pytest.raises(ValueError, match="unknown streams components"):
        create_app(KafkaSettings(), S, WorkerSettings(app_id="unit"), ["planner"])


def test_streams_worker_rejects_an_unknown_component_in_one_line():
    result = CliRunner().invoke(streams_cmd.app, ["worker", "--components", "router,planner"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["rollstream streams worker: unknown components ['planner']; choose from router, aggregator, batcher, metrics"]


def test_dispatch_rejects_an_unknown_split_in_one_line():
    result = CliRunner().invoke(dispatch_cmd.app, ["--run", "r", "--families", "calc:nope", "--max-groups", "1"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["rollstream dispatch: family 'calc' has no split 'nope'; splits: dev, rl, train"]


class _Buffer:
    """What drain_before_commit uses of Faust's ProducerBuffer."""

    should_stop = False

    def __init__(self) -> None:
        self.queued: list = []

    def put(self, fut) -> None:
        self.queued.append(fut)


def test_commit_flush_waits_past_fausts_give_up_for_every_buffered_write():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        buffer = _Buffer()
        drain_before_commit(buffer)
        first, second = loop.create_future(), loop.create_future()
        buffer.put(first)
        buffer.put(second)
        assert buffer.queued == [first, second]
        flush = asyncio.ensure_future(buffer.flush())
        loop.call_later(0.3, first.set_result, None)  # acknowledged well after Faust's 0.1 s give-up
        await asyncio.sleep(0.4)
        assert not flush.done()
        second.set_result(None)
        await asyncio.wait_for(flush, 1)
        failing = loop.create_future()
        buffer.put(failing)
        failing.set_exception(OSError("broker gone"))
        with pytest.raises(RuntimeError, match="1 table changelog writes failed"):
            await buffer.flush()
        await buffer.flush()  # nothing left to wait for

    asyncio.run(scenario())


def test_the_router_control_topic_refuses_what_is_not_a_heartbeat_or_weight_version():
    with pytest.raises(ValueError, match="not task_requested"):
        rt.on_control({}, codec().encode("task_requested", samples.task_requested(0)), 0, S)


def test_newest_by_key_keeps_the_highest_order_of_each_key_and_the_later_of_equals():
    ranked = [("run-a", 3, "a3"), ("run-b", 1, "b1"), ("run-a", 5, "a5"), ("run-a", 4, "a4"), ("run-b", 1, "b1-again")]
    assert newest_by_key(ranked) == {"run-a": "a5", "run-b": "b1-again"}
    assert newest_by_key([]) == {}


def _intakes(run: str | None, now_ms: int) -> dict[str, object]:
    wiring = create_wiring(KafkaSettings(), S, WorkerSettings(app_id="unit", web_enabled=False, run=run),
                           clock=lambda: now_ms)
    return {intake.name: intake for intake in wiring.intakes}


def test_a_new_app_is_seeded_with_the_newest_weight_version_of_each_served_run_only():
    intakes = _intakes("run-a", T0)
    assert {name: (i.source, i.target, i.partitions) for name, i in intakes.items()} == {
        "router-engines-intake": (topics.ENGINES, "unit-router-in", 8),
        "router-weights-intake": (topics.WEIGHTS, "unit-router-in", 8),
        "aggregator-weights-intake": (topics.WEIGHTS, "unit-aggregator-in", 8),
        "batcher-weights-intake": (topics.WEIGHTS, "unit-batcher-in", 1)}

    def version(run: str, v: int) -> bytes:
        return codec().encode("weight_version", {**samples.weight_version(), "run": run, "version": v})

    history = [version("run-a", 1), version("run-b", 7), version("run-a", 3), b"\x00not avro",
               version("run-a", 2)]
    for name in ("router-weights-intake", "aggregator-weights-intake", "batcher-weights-intake"):
        assert intakes[name].newest(history) == {"run-a": version("run-a", 3)}


def test_the_engines_intake_forwards_only_live_heartbeats_of_engines_serving_the_run():
    def heartbeat(engine: str, run: str, age_ms: int) -> dict:
        return {**samples.engine_heartbeat(), "engine_id": engine, "run": run, "sent_at_ms": T0 - age_ms}

    select = _intakes("run-a", T0)["router-engines-intake"].select
    liveness_ms = int(S.engine_liveness_s * 1000)
    assert select(heartbeat("e1", "run-a", 0)) == ("e1", T0)
    assert select(heartbeat("e3", "", liveness_ms)) == ("e3", T0 - liveness_ms)  # names no run: any run's
    assert select(heartbeat("e4", "run-a", liveness_ms + 1)) is None  # routing.is_live never counts it
    assert select(heartbeat("e2", "run-b", 0)) is None
    assert _intakes(None, T0)["router-engines-intake"].select(heartbeat("e2", "run-b", 0)) == ("e2", T0)


def test_the_engines_intake_forwards_an_engines_steady_beats_once_per_third_of_the_liveness_timeout():
    liveness_ms = int(S.engine_liveness_s * 1000)
    now = [T0]
    wiring = create_wiring(KafkaSettings(), S, WorkerSettings(app_id="unit", web_enabled=False), clock=lambda: now[0])
    select = next(i for i in wiring.intakes if i.name == "router-engines-intake").select
    forwarded = []
    for sent in range(T0, T0 + liveness_ms, 2000):  # beats every 2 s for one liveness timeout
        now[0] = sent
        if select({**samples.engine_heartbeat(), "sent_at_ms": sent, "queue_depth": sent % 7}):
            forwarded.append(sent - T0)
    assert forwarded == [0, 10_000, 20_000]
    now[0] += 1
    moved = {**samples.engine_heartbeat(), "sent_at_ms": now[0], "loaded_version": 99}
    assert select(moved) == (moved["engine_id"], now[0])  # a new loaded version is routed on at once


def test_a_tagged_tables_changelog_reads_back_the_bytes_it_wrote():
    # recovery reads a changelog with the changelog topic's serializer, not the table's
    app = create_app(KafkaSettings(), S, WorkerSettings(app_id="unit", web_enabled=False))
    value = {"input_ids": b"", "packed": b"\x00\x01\xff", "nested": {"raw": b"abc"}}
    for table in app.tables.values():
        if isinstance(table.value_serializer, TaggedJSON):
            written = app.serializers.dumps_value(None, value, serializer=table.value_serializer)
            assert app.serializers.loads_value(None, written, serializer=table.changelog_topic.value_serializer) == value
