"""The streams jobs' per-event handlers with plain dicts standing in for their Faust tables, the
table codec, the App factory and the CLI user errors. No broker: the Faust glue around these
handlers runs against the real one in tests/integration/test_streams_*.py."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline import dispatch_cmd, streams_cmd
from pipeline.bench_streams import trajectory, weights
from schemas import samples, topics
from schemas.codec import codec
from schemas.settings import KafkaSettings
from streams import aggregator_agent as agg
from streams import batcher_agent as bat
from streams import metrics_agent as met
from streams import router_agent as rt
from streams import routing
from streams.advantages import grpo_advantages
from streams.app import WorkerSettings, create_app
from streams.serde import TaggedJSON
from streams.settings import StreamsSettings

N = 4
S = StreamsSettings(group_size=N, batch_size=1, first_batch_factor=1.0, min_members=2, group_timeout_s=10)
T0 = 1_000_000


def _tables() -> agg.AggregatorTables:
    return agg.AggregatorTables({}, {}, {})


def _encoded(gid: str, member: int, reward: float, **kw) -> bytes:
    return codec().encode("trajectory", trajectory("r", gid, member, N, reward, num_tokens=8 + member, **kw))


def _decode_outs(outs):
    return [(topic, codec().decode(value, topics.EVENT_OF_TOPIC[topic])) for topic, _, value in outs]


def test_group_is_emitted_with_full_members_when_the_last_arrives_and_members_are_freed():
    tables = _tables()
    rewards = [1.0, 0.0, 0.5, 1.0]
    sent = [_encoded("g", m, r) for m, r in enumerate(rewards)]
    outs = [agg.on_trajectory(tables, data, 0, T0 + m, S) for m, data in enumerate(sent)]
    assert outs[:3] == [[], [], []]
    [(topic, group)] = _decode_outs(outs[3])
    assert topic == topics.GROUPS and group["completion"] == "complete"
    np.testing.assert_allclose([m["advantage"] for m in group["members"]], grpo_advantages(rewards, ["g"] * N))
    assert [m["trajectory"] for m in group["members"]] == [codec().decode(data, "trajectory") for data in sent]
    assert tables.members == {}
    assert tables.groups["g"]["closed"] == "emitted" and tables.groups["g"]["partition"] == 0


def test_group_state_keeps_no_token_arrays():
    tables = _tables()
    data = _encoded("g", 0, 1.0)
    agg.on_trajectory(tables, data, 0, T0, S)
    member = tables.groups["g"]["members"]["0"]
    assert (member["input_ids"], member["loss_mask"], member["rollout_logprobs"]) == (b"", b"", b"")
    assert tables.members["g/0"] == data


def test_duplicate_member_is_dropped_and_counted():
    tables = _tables()
    agg.on_trajectory(tables, _encoded("g", 0, 1.0), 1, T0, S)
    assert agg.on_trajectory(tables, _encoded("g", 0, 1.0), 1, T0 + 5, S) == []
    assert tables.groups["g"]["arrivals"] == {"0": T0}
    assert tables.partitions["p1"]["stats"]["r"]["counters"] == {"duplicates": 1}


def test_tick_closes_only_its_own_partitions_timed_out_groups():
    tables = _tables()
    for m in range(3):
        agg.on_trajectory(tables, _encoded("a", m, float(m)), 0, T0, S)
        agg.on_trajectory(tables, _encoded("b", m, float(m)), 1, T0, S)
    assert agg.on_tick(tables, 0, T0 + 9_999, S) == []
    [(topic, group)] = _decode_outs(agg.on_tick(tables, 0, T0 + 10_000, S))
    assert (topic, group["group_id"], group["completion"]) == (topics.GROUPS, "a", "timeout")
    assert tables.groups["b"]["closed"] is None


def test_group_with_too_few_members_is_reported_as_dropped_metric():
    tables = _tables()
    agg.on_trajectory(tables, _encoded("g", 0, 1.0), 0, T0, S)
    [(topic, metric)] = _decode_outs(agg.on_tick(tables, 0, T0 + 10_000, S))
    assert (topic, metric["name"], metric["labels"]["group_id"], metric["labels"]["reason"]) == \
        (topics.METRICS, "streams/group_dropped", "g", "too_few_members")
    assert tables.members == {}


def test_group_behind_the_learner_by_more_than_max_staleness_is_dropped():
    tables = _tables()
    agg.on_weights(tables, codec().encode("weight_version", weights("r", 100)), 0)
    [(_, metric)] = _decode_outs(agg.on_trajectory(tables, _encoded("g", 0, 1.0, version=10), 0, T0, S))
    assert metric["labels"]["reason"] == "stale"


def test_expired_tombstones_are_deleted_by_the_sweep():
    tables = _tables()
    for m in range(N):
        agg.on_trajectory(tables, _encoded("g", m, float(m)), 0, T0, S)
    agg.on_tick(tables, 0, T0 + int(S.closed_retention_s * 1000), S)
    assert "g" not in tables.groups


def _group(gid: str, run: str = "r", members: int = N) -> bytes:
    g = {**samples.group(), "group_id": gid, "run": run, "group_size": members,
         "members": [{"trajectory": {**samples.trajectory(m), "group_id": gid, "run": run}, "advantage": float(m),
                      "masked": False} for m in range(members)]}
    return codec().encode("group", g)


def test_first_batch_needs_no_credit_and_the_next_waits_for_a_newer_version():
    tables = bat.BatcherTables({}, {}, {})
    [(topic, first)] = _decode_outs(bat.on_batcher_event(tables, _group("g0"), T0, S))
    assert (topic, first["index"], first["credit_version"], first["group_ids"]) == (topics.BATCHES, 0, 0, ["g0"])
    assert bat.on_batcher_event(tables, _group("g1"), T0, S) == []
    assert bat.on_batcher_event(tables, codec().encode("weight_version", weights("r", 0)), T0, S) == []
    [(_, second)] = _decode_outs(bat.on_batcher_event(tables, codec().encode("weight_version", weights("r", 1)), T0, S))
    assert (second["index"], second["credit_version"], second["group_ids"]) == (1, 1, ["g1"])
    assert tables.ready == {} and tables.batched == {"g0": first["batch_id"], "g1": second["batch_id"]}


def test_redelivered_group_is_batched_once():
    tables = bat.BatcherTables({}, {}, {})
    bat.on_batcher_event(tables, _group("g0"), T0, S)
    bat.on_batcher_event(tables, codec().encode("weight_version", weights("r", 1)), T0, S)
    assert bat.on_batcher_event(tables, _group("g0"), T0, S) == []
    assert tables.state["r"]["ready"] == []


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


def test_table_codec_round_trips_bytes_inside_nested_values():
    value = {"members": {"0": {"input_ids": b"\x00\xff", "turns": [{"n": 1}]}}, "closed": None}
    codec_ = TaggedJSON()
    assert codec_.loads(codec_.dumps(value)) == value


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


def test_create_app_declares_only_the_chosen_jobs():
    app = create_app(KafkaSettings(), S, WorkerSettings(app_id="unit", web_enabled=False), ["batcher"])
    assert set(app.agents) == {"batcher-intake", "batcher-weights-intake", "batcher"}
    with pytest.raises(ValueError, match="unknown streams components"):
        create_app(KafkaSettings(), S, WorkerSettings(app_id="unit"), ["planner"])


def test_streams_worker_rejects_an_unknown_component_in_one_line():
    result = CliRunner().invoke(streams_cmd.app, ["worker", "--components", "router,planner"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["rollstream streams: unknown components ['planner']; choose from router, aggregator, batcher, metrics"]


def test_dispatch_rejects_an_unknown_split_in_one_line():
    result = CliRunner().invoke(dispatch_cmd.app, ["--run", "r", "--families", "calc:nope", "--max-groups", "1"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["rollstream dispatch: family 'calc' has no split 'nope'; splits: dev, train"]
