"""Batch construction options (issue 25, part 4), each against its formula, and off by default:
RAGEN's variance filter, ERPO-style normalization, the windowed FIFO, the positive-only start and
ScalingInter-RL's turn schedule. The defaults must cut exactly the batches they cut before."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from env_workers.agent_loop import run_agent_loop
from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import Generation
from env_workers.settings import AgentLoopSettings
from pipeline.cli import app
from pipeline.policy.model_init import build_tokenizer
from pipeline.run.config import RollstreamConfig
from pipeline.run.study import VARIANTS, variant_config
from schemas import samples, synthetic, topics
from schemas.codec import codec
from streams import aggregation, routing
from streams import batcher_state as bat
from streams import router_agent as rt
from streams.advantages import batch_advantages, erpo_advantages, task_normalize_counts, weighted_mean_std
from streams.batching import action_tokens, build_batch, split_by_window, variance_filter
from streams.settings import StreamsSettings

T0 = 1_000_000
RUN = "r"
S = StreamsSettings(group_size=4, batch_size=2)  # min 8 trajectories, first batch ceil(1.7 * 8) = 14


def _trajectory(gid: str, member: int, reward: float, task: str, masked: bool) -> dict[str, Any]:
    t = synthetic.trajectory(RUN, gid, member, 4, reward, task=task, num_tokens=8 + 4 * member + len(gid),
                             status="task_error" if masked else "completed")
    t["finished_at_ms"] = 0  # synthetic stamps the wall clock; the digest below must not depend on it
    return t


def _group(gid: str, rewards, task: str = "os", masked=(), arrived: int = T0) -> dict[str, Any]:
    """A real groups event: the aggregator's own state machine builds it (GRPO advantages included)."""
    state = None
    for m, r in enumerate(rewards):
        state = aggregation.add_member(state, _trajectory(gid, m, r, task, m in masked), arrived + m).state
    return aggregation.decide(state, arrived + 100, 0, S).group


def _weights(version: int) -> bytes:
    return codec().encode("weight_version", synthetic.weights(RUN, version))


# groups (id, rewards, task, masked members) and learner versions, in arrival order
SCENARIO = [
    ("g0", [1.0, 0.0, 1.0, 0.0], "os", ()), ("g1", [0.5, 0.25, 1.0, 0.0], "db", (3,)),
    ("g2", [1.0, 1.0, 1.0, 1.0], "os", ()), ("g3", [0.0, 1.0, 0.0, 0.0], "db", ()),
    1,
    ("g4", [0.2, 0.9, -0.2, 0.4], "os", ()), ("g5", [1.0, 0.0, 0.0, 0.0], "calc", ()),
    ("g6", [-0.2, -0.2, 1.0, 0.3], "db", (0,)),
    2,
    ("g7", [0.0, 0.7, 0.1, 1.0], "calc", ()), ("g8", [1.0, 0.5, 0.5, 0.0], "os", ()),
    3,
]
TODAYS_DIGEST = "7981f44ba364bb73eaacf8b4aa2d7a3e24412204e94910573f4414507091c44f"
"""sha256 of the scenario's batches (groups, items, advantages, task stats) as the batcher cut them
before these options existed (computed with the code of the commit they were added to)."""


def _run(settings: StreamsSettings, scenario=SCENARIO, now_ms: int = T0 + 1000):
    """Feeds the scenario to the batcher state machine; (batches, drop metrics, tables)."""
    tables = bat.BatcherTables({}, {}, {})
    batches, drops = [], []
    for e in scenario:
        data = _weights(e) if isinstance(e, int) else codec().encode("group", _group(*e))
        outs, _ = bat.on_batcher_event(tables, data, now_ms, settings)
        batches += [codec().decode(v, "batch") for topic, _, v in outs if topic == topics.BATCHES]
        drops += [codec().decode(v, "metric") for topic, _, v in outs if topic == topics.METRICS]
    return batches, drops, tables


def _digest(batches) -> str:
    essence = [{"group_ids": b["group_ids"], "index": b["index"], "credit": b["credit_version"],
                "items": [[i["trajectory"]["trajectory_id"], i["group_advantage"], i["advantage"]] for i in b["items"]],
                "task_stats": b["task_stats"]} for b in batches]
    return hashlib.sha256(json.dumps(essence, sort_keys=True).encode()).hexdigest()


# -- defaults --------------------------------------------------------------------------------

def test_every_batch_option_is_off_by_default():
    s = StreamsSettings()
    assert (s.variance_filter_keep, s.adv_norm, s.fifo_window_s, s.positive_only_steps, s.turn_schedule) == \
        (1.0, "group", None, 0, ())


def test_default_settings_cut_exactly_todays_batches_and_advantages():
    batches, drops, _ = _run(S)
    assert [b["group_ids"] for b in batches] == [["g0", "g1", "g2"], ["g3", "g4"], ["g5", "g6"], ["g7", "g8"]]
    assert _digest(batches) == TODAYS_DIGEST and drops == []
    explicit_off = S.model_copy(update={"variance_filter_keep": 1.0, "adv_norm": "group", "fifo_window_s": None,
                                        "positive_only_steps": 0, "turn_schedule": ()})
    assert _digest(_run(explicit_off)[0]) == TODAYS_DIGEST


def test_default_batch_advantages_are_bitwise_the_task_normalization():
    rng = np.random.default_rng(0)
    adv, rewards = rng.normal(size=40), rng.random(40)
    groups, tasks, counts = [i // 4 for i in range(40)], [("os", "db", "kg")[i % 3] for i in range(40)], \
        rng.integers(0, 30, 40)
    for normalize in (True, False):
        final, stats = batch_advantages(adv, rewards, groups, tasks, counts, normalize=normalize)
        want, want_stats = task_normalize_counts(adv, tasks, counts, normalize=normalize)
        assert final.tobytes() == want.tobytes() and stats == want_stats


# -- RAGEN's variance filter -----------------------------------------------------------------

def test_variance_filter_keeps_int_ratio_times_groups_of_largest_reward_std():
    rng = np.random.default_rng(1)
    groups = [_group(f"v{i}", rng.random(4).round(3).tolist()) for i in range(12)]
    settings = S.model_copy(update={"variance_filter_keep": 0.25})
    kept, filtered = variance_filter(groups, settings)
    stds = [np.std([m["trajectory"]["reward"] for m in g["members"]], ddof=1) for g in groups]
    top = set(np.argsort(stds)[::-1][:int(0.25 * 12)])  # RAGEN: int(ratio * num_groups) by largest std
    assert [g["group_id"] for g in kept] == [f"v{i}" for i in sorted(top)]  # arrival order kept
    assert len(filtered) == 9 and {g["group_id"] for g in kept + filtered} == {g["group_id"] for g in groups}


def test_variance_filter_keeps_at_least_one_group_and_breaks_ties_by_arrival():
    groups = [_group("a", [1, 1, 1, 1]), _group("b", [1, 0, 1, 0]), _group("c", [0, 1, 0, 1])]
    kept, filtered = variance_filter(groups, S.model_copy(update={"variance_filter_keep": 0.01}))
    assert [g["group_id"] for g in kept] == ["b"] and [g["group_id"] for g in filtered] == ["a", "c"]


def test_variance_filter_keeps_the_batch_a_multiple_of_the_data_parallel_lcm():
    settings = S.model_copy(update={"variance_filter_keep": 0.5, "data_parallel_multiple": 8})  # lcm(4, 8) = 8
    groups = [_group(f"v{i}", [0, i % 3, 1, 0.5]) for i in range(6)]
    kept, _ = variance_filter(groups, settings)
    assert sum(len(g["members"]) for g in kept) == 8  # half of 24 is 12, rounded down to 8: two groups


def test_filtered_groups_are_consumed_by_the_cut_and_reported_as_dropped():
    settings = S.model_copy(update={"variance_filter_keep": 0.5})
    batches, drops, tables = _run(settings)
    # each cut keeps half its trajectories, at least one group of 4, largest reward std first:
    # g0 (std .58) of g0, g1 (.38), g2 (0); g3 (.5) of g3, g4 (.46); g6 (.60, 3 members) of g5, g6; g7 of g7, g8
    assert [b["group_ids"] for b in batches] == [["g0"], ["g3"], ["g6"], ["g7"]]
    assert [(d["name"], d["labels"]["group_id"], d["labels"]["reason"]) for d in drops] == [
        (topics.GROUP_DROPPED_METRIC, gid, "variance_filter") for gid in ("g1", "g2", "g4", "g5", "g8")]
    assert drops[0]["labels"]["task"] == "db" and drops[0]["source"] == "streams/batcher"
    assert tables.ready == {} and tables.queue == {} and tables.state[RUN]["available"] == 0
    # a redelivered filtered group is not offered again
    assert bat.on_batcher_event(tables, codec().encode("group", _group("g2", [1.0] * 4)), T0, settings) == ([], [])


# -- ERPO-style normalization ----------------------------------------------------------------

def test_erpo_advantage_is_reward_minus_group_mean_over_environment_std():
    rewards = [1.0, 0.0, 0.5, 0.5, 1.0, 0.0]
    groups, envs = ["q1", "q1", "q2", "q2", "q3", "q3"], ["os", "os", "os", "os", "db", "db"]
    got = erpo_advantages(rewards, groups, envs, std="bessel", eps=1e-6)
    os_std, db_std = np.std([1.0, 0.0, 0.5, 0.5], ddof=1), np.std([1.0, 0.0], ddof=1)
    want = [0.5 / (os_std + 1e-6), -0.5 / (os_std + 1e-6), 0.0, 0.0, 0.5 / (db_std + 1e-6), -0.5 / (db_std + 1e-6)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_erpo_environment_of_one_reward_value_and_a_group_of_one_get_zero():
    assert erpo_advantages([1.0, 1.0, 0.3], ["a", "b", "c"], ["os", "os", "db"]).tolist() == [0.0, 0.0, 0.0]


def test_erpo_batch_reports_grpo_before_and_erpo_after():
    settings = S.model_copy(update={"adv_norm": "erpo", "task_adv_norm": False})
    groups = [_group("a", [1.0, 0.0, 1.0, 0.0]), _group("b", [0.5, 0.25, 1.0, 0.0], task="db")]
    batch = build_batch(RUN, 1, 1, groups, settings, T0)
    members = [m for g in groups for m in g["members"]]
    want = erpo_advantages([m["trajectory"]["reward"] for m in members], ["a"] * 4 + ["b"] * 4,
                           ["os"] * 4 + ["db"] * 4)
    assert [i["advantage"] for i in batch["items"]] == want.tolist()
    assert [i["group_advantage"] for i in batch["items"]] == [m["advantage"] for m in members]
    os_stats = next(s for s in batch["task_stats"] if s["task"] == "os")
    tokens = np.array([action_tokens(m["trajectory"]) for m in members[:4]])
    adv = np.array([m["advantage"] for m in members[:4]])
    assert (os_stats["mean_before"], os_stats["std_before"]) == weighted_mean_std(adv, tokens, "bessel")
    assert (os_stats["mean_after"], os_stats["std_after"]) == weighted_mean_std(want[:4], tokens, "bessel")


def test_erpo_with_task_normalization_is_refused():
    with pytest.raises(ValidationError, match="task_adv_norm false"):
        StreamsSettings(adv_norm="erpo")


def test_advantages_command_applies_erpo_and_refuses_it_with_task_normalization(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"rewards": [1, 0, 0.5, 0.5], "group_ids": [0, 0, 1, 1], "task_ids": ["os"] * 4,
                                "loss_masks": [[0, 1], [0, 1, 1], [1], [1, 1]]}))
    result = CliRunner().invoke(app, ["advantages", "--input", str(path), "--adv-norm", "erpo", "--no-task-adv-norm"])
    assert result.exit_code == 0, result.output
    sd = np.std([1, 0, 0.5, 0.5], ddof=1)
    np.testing.assert_allclose(json.loads(result.stdout)["final"], [0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0, 0])
    refused = CliRunner().invoke(app, ["advantages", "--input", str(path), "--adv-norm", "erpo"])
    assert refused.exit_code != 0 and "add --no-task-adv-norm" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


# -- windowed FIFO ---------------------------------------------------------------------------

def test_window_splits_off_groups_that_first_arrived_more_than_the_window_ago():
    settings = S.model_copy(update={"fifo_window_s": 60.0})
    ready = [{"group_id": "old", "first_arrival_ms": T0}, {"group_id": "edge", "first_arrival_ms": T0 + 1},
             {"group_id": "new", "first_arrival_ms": T0 + 50_000}, {"group_id": "unstamped"}]
    inside, expired = split_by_window(ready, T0 + 60_001, settings)
    assert [g["group_id"] for g in inside] == ["edge", "new", "unstamped"]  # FIFO order kept
    assert [g["group_id"] for g in expired] == ["old"]
    assert split_by_window(ready, T0 + 10**9, S) == (ready, [])  # no window


def test_expired_groups_are_dropped_at_the_cut_and_the_fresh_ones_batched():
    settings = S.model_copy(update={"fifo_window_s": 60.0})
    old = [("o0", [1, 0, 1, 0], "os", (), T0), ("o1", [1, 0, 0, 0], "db", (), T0)]
    fresh = [(f"f{i}", [0, 1, 0, 1], "os", (), T0 + 70_000) for i in range(4)]
    batches, drops, tables = _run(settings, [*old, *fresh], now_ms=T0 + 90_000)
    assert [b["group_ids"] for b in batches] == [["f0", "f1", "f2", "f3"]]
    assert [(d["labels"]["group_id"], d["labels"]["reason"]) for d in drops] == [("o0", "fifo_window"),
                                                                                ("o1", "fifo_window")]
    assert tables.batched["o0"]["batch_id"] is None and tables.state[RUN]["available"] == 0


def test_expired_groups_are_dropped_even_when_too_few_fresh_ones_remain_for_a_cut():
    settings = S.model_copy(update={"fifo_window_s": 60.0})
    scenario = [(f"o{i}", [1, 0, 1, 0], "os", (), T0) for i in range(4)]
    batches, drops, tables = _run(settings, scenario, now_ms=T0 + 90_000)
    assert batches == [] and len(drops) == 4 and tables.queue == {} and tables.state[RUN]["available"] == 0


# -- positive-only start ---------------------------------------------------------------------

def test_first_n_batches_train_only_on_the_positive_part_of_each_advantage():
    settings = S.model_copy(update={"positive_only_steps": 2})
    groups = [_group("a", [1.0, 0.0, 1.0, 0.2]), _group("b", [0.5, 0.25, 1.0, 0.0], task="db")]
    plain = build_batch(RUN, 2, 2, groups, settings, T0)  # batch 2: the curriculum is over
    early = build_batch(RUN, 1, 1, groups, settings, T0)
    assert plain == build_batch(RUN, 2, 2, groups, S, T0)
    assert [i["advantage"] for i in early["items"]] == [max(i["advantage"], 0.0) for i in plain["items"]]
    assert any(i["advantage"] < 0 for i in plain["items"])
    assert all(s["mean_after"] > 0 for s in early["task_stats"])  # the stats describe what is trained


# -- per-family advantage scale ---------------------------------------------------------------

def test_a_family_scale_multiplies_that_familys_final_advantages_after_normalization_and_no_others():
    groups = [_group("a", [1.0, 0.0, 1.0, 0.2]), _group("b", [0.5, 0.25, 1.0, 0.0], task="db"),
              _group("c", [0.0, 1.0, 0.0, 0.0], task="db")]
    plain = build_batch(RUN, 1, 1, groups, S, T0)
    scaled = build_batch(RUN, 1, 1, groups, S.model_copy(update={"task_advantage_scale": {"db": 0.25}}), T0)
    for before, after in zip(plain["items"], scaled["items"]):
        factor = 0.25 if before["trajectory"]["task"] == "db" else 1.0
        assert after["advantage"] == pytest.approx(factor * before["advantage"])
        assert after["group_advantage"] == before["group_advantage"]
    assert any(i["advantage"] != 0 for i in plain["items"] if i["trajectory"]["task"] == "db")
    stats = {s["task"]: s for s in scaled["task_stats"]}
    plain_stats = {s["task"]: s for s in plain["task_stats"]}
    assert stats["db"]["std_after"] == pytest.approx(0.25 * plain_stats["db"]["std_after"])  # what is trained
    assert stats["os"] == plain_stats["os"] and stats["db"]["std_before"] == plain_stats["db"]["std_before"]


def test_the_family_scale_applies_after_the_positive_only_start():
    settings = S.model_copy(update={"positive_only_steps": 2, "task_advantage_scale": {"os": 3.0}})
    groups = [_group("a", [1.0, 0.0, 1.0, 0.2])]
    positive = build_batch(RUN, 1, 1, groups, S.model_copy(update={"positive_only_steps": 2}), T0)
    both = build_batch(RUN, 1, 1, groups, settings, T0)
    assert [i["advantage"] for i in both["items"]] == pytest.approx([3.0 * i["advantage"] for i in positive["items"]])


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_a_family_scale_must_be_positive(scale):
    with pytest.raises(ValidationError, match="greater than 0"):
        StreamsSettings(task_advantage_scale={"os": scale})


def test_a_family_scale_is_refused_when_the_learner_computes_the_advantages():
    with pytest.raises(ValidationError, match="task_advantage_scale cannot apply"):
        StreamsSettings(advantage="none", group_size=1, min_members=1, task_advantage_scale={"os": 0.5})


def test_a_family_scale_must_name_a_trained_family():
    RollstreamConfig(mix={"families": ["calc:rl", "os"]}, streams={"task_advantage_scale": {"calc": 0.5}})
    with pytest.raises(ValidationError, match="names clac, not among mix.families"):
        RollstreamConfig(mix={"families": ["calc:rl", "os"]}, streams={"task_advantage_scale": {"clac": 0.5}})


# -- ScalingInter-RL turn schedule -----------------------------------------------------------

SCHEDULE = ((0, 8), (100, 12), (200, 15))


@pytest.mark.parametrize("version,turns", [(0, 8), (99, 8), (100, 12), (199, 12), (200, 15), (10**6, 15)])
def test_turn_budget_is_the_stage_of_the_learner_version(version, turns):
    assert routing.turn_budget(version, SCHEDULE, 20) == turns
    assert routing.turn_budget(version, (), 20) == 20


@pytest.mark.parametrize("schedule,message", [(((1, 8),), "version 0"), (((0, 8), (0, 12)), "increase"),
                                              (((0, 8), (10, 21)), "1..max_turns")])
def test_turn_schedule_must_start_at_version_0_rise_and_stay_within_max_turns(schedule, message):
    with pytest.raises(ValidationError, match=message):
        StreamsSettings(turn_schedule=schedule)


def _routed(settings: StreamsSettings, version: int, validation: bool = False) -> dict[str, Any]:
    table: dict = {}
    rt.on_router_event(table, codec().encode("weight_version", synthetic.weights("example", version)), 0, T0, settings)
    request = {**samples.task_requested(1), "validation": validation}
    [(_, _, data)] = rt.on_router_event(table, codec().encode("task_requested", request), 0, T0, settings)
    return codec().decode(data, "task")


def test_router_gives_training_tasks_their_stage_budget_and_validation_the_full_one():
    settings = StreamsSettings(turn_schedule=SCHEDULE)
    for version, turns in ((0, 8), (150, 12), (250, 15)):
        task = _routed(settings, version)
        assert task["max_turns"] == len(task["turn_pools"]) == turns
    assert _routed(settings, 0, validation=True)["max_turns"] == 20
    assert _routed(StreamsSettings(), 150)["max_turns"] == 20  # no schedule: max_turns


def test_task_written_before_the_budget_field_decodes_with_none():
    old = {k: v for k, v in samples.task().items() if k != "max_turns"}
    assert codec().decode(codec().encode("task", old, schema_version=1), "task") == {**old, "max_turns": None}


@dataclass
class _Observation:
    messages: list
    reward: float
    status: str
    finish: bool
    metrics: dict


class _EndlessEnv:
    """Answers every tool call and never finishes."""

    async def start(self, sample):
        return type("Session", (), {"messages": [{"role": "user", "content": "Add 1 and 2."}], "tools": []})()

    async def observation(self, session, message):
        return _Observation([{"role": "user", "content": "Go on."}], 0.0, "running", False, {})

    async def end(self, session):
        pass


def test_agent_loop_stops_at_the_tasks_turn_budget():
    encoder = ChatEncoder(build_tokenizer())
    reply = [*encoder.encode_text("Thinking."), encoder.eos_token_id]

    class Engine:
        async def generate(self, prompt_ids, max_tokens, temperature):
            return Generation(reply, [-0.5] * len(reply), "stop", "c0", 0)

    ticks = itertools.count()
    settings = AgentLoopSettings(max_turns=6, engine_retry_backoff_s=0.0)

    def rollout(budget):
        task = {**samples.task(), "turn_pools": ["current"] * 6, "max_turns": budget}
        return asyncio.run(run_agent_loop(task, {}, _EndlessEnv(), encoder, lambda pool: (pool, Engine()), settings,
                                          worker_id="w", clock=lambda: 1.0 + next(ticks) * 0.01,
                                          sleep=lambda s: asyncio.sleep(0))).trajectory

    for budget, turns in ((3, 3), (None, 6), (9, 6)):  # None: an old task event; never above agent_loop's own
        t = rollout(budget)
        assert (t["status"], t["termination"], len(t["turns"])) == ("task_limit_reached", "max_turns", turns)


# -- study variants --------------------------------------------------------------------------

@pytest.mark.parametrize("variant,field", [("variance-filter", "variance_filter_keep"), ("erpo-norm", "adv_norm"),
                                           ("fifo-window", "fifo_window_s"), ("positive-first", "positive_only_steps"),
                                           ("turn-schedule", "turn_schedule")])
def test_each_batch_option_is_a_study_variant_that_fits_the_cpu_config(variant, field):
    assert field in VARIANTS[variant]["streams"]
    cpu = RollstreamConfig(agent_loop={"max_turns": 6}, streams={"max_turns": 6, "batch_size": 6}, max_steps=24,
                           mix={"val_interval": 24})
    assert getattr(variant_config(cpu, variant, 0).streams, field) != getattr(StreamsSettings(), field)
