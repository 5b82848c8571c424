"""The group buffer: dedup, completion, masking, timeout, staleness, all-equal filter, counters."""

import json

import pytest

from schemas.arrays import pack_ids, pack_logprobs, pack_mask
from schemas.codec import codec, encode
from streams.advantages import grpo_advantages
from streams.aggregation import (
    InvalidTrajectory, add_member, decide, dropped_share, dropped_share_exceeded, expired_tombstones, sweep, tally,
)
from streams.settings import StreamsSettings

SETTINGS = StreamsSettings(group_size=4, min_members=2, group_timeout_s=60, max_staleness=40,
                           stale_step=25, max_stale_lag=5)


def trajectory(member, reward=1.0, status="completed", version=10, group_id="g1", group_size=4, task="os"):
    mask = [0, 1, 1, 0, 1]
    return {
        "trajectory_id": f"{group_id}-{member}", "run": "run", "group_id": group_id, "member": member,
        "group_size": group_size, "task": task, "split": "train", "sample_index": 7, "validation": False,
        "input_ids": pack_ids(range(5)), "loss_mask": pack_mask(mask), "rollout_logprobs": pack_logprobs([0.0] * 5),
        "arrays_uri": None, "num_tokens": 5, "prompt_tokens": 1,
        "turns": [{"turn": 0, "pool": "current", "engine_id": "c0", "weight_version": version, "start": 1,
                   "length": 2, "generate_ms": 1.0, "env_ms": 1.0},
                  {"turn": 1, "pool": "stale", "engine_id": "s0", "weight_version": version + 1, "start": 4,
                   "length": 1, "generate_ms": 1.0, "env_ms": 1.0}],
        "status": status, "reward": reward, "env_reward": reward, "termination": "env_finished",
        "template_fingerprint": "f", "worker_id": "w", "started_at_ms": 0, "finished_at_ms": 1,
        "score": None, "metrics": {},
    }


def fill(trajectories, start_ms=1_000):
    state = None
    for i, t in enumerate(trajectories):
        state = add_member(state, t, start_ms + i).state
    return state


def test_group_trains_only_when_all_members_arrived():
    rewards = [1.0, 0.0, 0.5, 1.0]
    state = fill([trajectory(m, r) for m, r in enumerate(rewards[:3])])
    assert decide(state, 2_000, 12, SETTINGS).action == "wait"
    state = add_member(state, trajectory(3, rewards[3]), 2_000).state
    d = decide(state, 2_500, 12, SETTINGS)
    assert (d.action, d.reason) == ("emit", "complete")
    assert [m["advantage"] for m in d.group["members"]] == pytest.approx(list(grpo_advantages(rewards, [0] * 4)))
    assert d.counts == {"emitted": 1, "emitted_complete": 1, "masked_members": 0}


def test_emitted_group_has_exactly_the_group_schema_fields_and_encodes():
    d = decide(fill([trajectory(m, float(m)) for m in range(4)]), 5_000, 12, SETTINGS)
    fields = {f["name"] for f in codec().schema("group")["fields"]}
    assert set(d.group) == fields
    encode("group", d.group)
    g = d.group
    assert (g["first_arrival_ms"], g["last_arrival_ms"], g["ready_at_ms"]) == (1_000, 1_003, 5_000)
    assert g["min_weight_version"] == 10 and g["reward_mean"] == 1.5
    assert [m["trajectory"]["member"] for m in g["members"]] == [0, 1, 2, 3]


def test_members_are_ordered_by_member_index_whatever_the_arrival_order():
    d = decide(fill([trajectory(m, float(m)) for m in (3, 0, 2, 1)]), 5_000, 12, SETTINGS)
    assert [m["trajectory"]["member"] for m in d.group["members"]] == [0, 1, 2, 3]


def test_duplicate_trajectory_is_dropped():
    state = fill([trajectory(0), trajectory(1)])
    result = add_member(state, trajectory(1, reward=0.0), 3_000)
    assert result.outcome == "duplicate" and result.counts == {"duplicates": 1}
    assert result.state["members"]["1"]["reward"] == 1.0


def test_late_member_of_closed_group_is_dropped():
    closed = decide(fill([trajectory(m, float(m)) for m in range(4)]), 5_000, 12, SETTINGS).state
    result = add_member(closed, trajectory(2), 6_000)
    assert result.outcome == "late" and result.state["closed"] == "emitted" and result.state["members"] == {}
    assert decide(result.state, 7_000, 12, SETTINGS).action == "wait"


def test_task_error_is_masked_not_punished():
    state = fill([trajectory(0, 1.0), trajectory(1, 0.0), trajectory(2, -0.2, status="task_error"),
                  trajectory(3, 1.0)])
    d = decide(state, 5_000, 12, SETTINGS)
    assert (d.action, d.reason) == ("emit", "masked")
    members = d.group["members"]
    assert [m["masked"] for m in members] == [False, False, True, False]
    assert members[2]["advantage"] == 0.0
    expected = grpo_advantages([1.0, 0.0, 1.0], [0] * 3)
    assert [members[i]["advantage"] for i in (0, 1, 3)] == pytest.approx(list(expected))
    assert d.group["reward_mean"] == pytest.approx(2 / 3)
    assert d.counts["masked_members"] == 1 and d.counts["emitted_masked"] == 1


def test_group_with_too_few_unmasked_members_is_dropped():
    state = fill([trajectory(0)] + [trajectory(m, status="task_error") for m in (1, 2, 3)])
    d = decide(state, 5_000, 12, SETTINGS)
    assert (d.action, d.reason, d.group) == ("drop", "too_few_members", None)
    assert d.state["closed"] == "dropped" and d.counts == {"dropped": 1, "dropped_too_few_members": 1}


def test_group_waits_for_missing_members_even_when_one_errored():
    state = fill([trajectory(0), trajectory(1, status="task_error"), trajectory(2, 0.0)])
    assert decide(state, 2_000, 12, SETTINGS).action == "wait"


def test_timed_out_group_completes_from_present_members():
    state = fill([trajectory(0, 1.0), trajectory(1, 0.0), trajectory(2, 0.0)])
    assert decide(state, 1_000 + 59_999, 12, SETTINGS).action == "wait"
    d = decide(state, 1_000 + 60_000, 12, SETTINGS)
    assert (d.action, d.reason, d.group["completion"]) == ("emit", "timeout", "timeout")
    assert len(d.group["members"]) == 3 and d.counts["timeouts"] == 1


def test_timed_out_group_with_one_member_is_dropped():
    d = decide(fill([trajectory(0)]), 100_000, 12, SETTINGS)
    assert (d.action, d.reason) == ("drop", "too_few_members") and d.counts["timeouts"] == 1


def test_sweep_finds_only_due_groups():
    states = {"old": fill([trajectory(0, group_id="old"), trajectory(1, 0.0, group_id="old")], start_ms=0),
              "new": fill([trajectory(0, group_id="new")], start_ms=50_000)}
    due = sweep(states, 61_000, 12, SETTINGS)
    assert list(due) == ["old"] and due["old"].reason == "timeout"


def test_group_behind_the_learner_by_more_than_max_staleness_is_dropped():
    state = fill([trajectory(0, version=10), trajectory(1, version=10)])
    assert decide(state, 2_000, 50, SETTINGS).action == "wait"  # 50 - 10 = 40: still allowed
    d = decide(state, 2_000, 51, SETTINGS)
    assert (d.action, d.reason) == ("drop", "stale") and d.counts == {"dropped": 1, "dropped_stale": 1}


def test_staleness_ignores_turns_of_masked_members():
    state = fill([trajectory(m, float(m % 2), version=20) for m in range(3)]
                 + [trajectory(3, status="task_error", version=0)])
    d = decide(state, 2_000, 55, SETTINGS)
    assert d.action == "emit" and d.group["min_weight_version"] == 20


def test_all_equal_group_is_counted_and_kept_by_default():
    d = decide(fill([trajectory(m, 1.0) for m in range(4)]), 5_000, 12, SETTINGS)
    assert d.action == "emit" and d.group["all_equal"] and d.counts["all_equal"] == 1
    assert all(m["advantage"] == 0.0 for m in d.group["members"])


def test_all_equal_group_is_dropped_when_filtering():
    settings = SETTINGS.model_copy(update={"filter_all_equal": True})
    d = decide(fill([trajectory(m, 0.0) for m in range(4)]), 5_000, 12, settings)
    assert (d.action, d.reason) == ("drop", "all_equal")
    assert d.counts == {"dropped": 1, "dropped_all_equal": 1, "all_equal": 1}


def test_trajectory_that_disagrees_with_its_group_is_invalid():
    state = fill([trajectory(0)])
    with pytest.raises(InvalidTrajectory, match="task"):
        add_member(state, trajectory(1, task="db"), 2_000)
    with pytest.raises(InvalidTrajectory, match="outside"):
        add_member(state, trajectory(4), 2_000)


def test_state_is_plain_data_and_inputs_are_not_mutated():
    state = fill([trajectory(0)])
    snapshot = json.dumps(state, default=bytes.hex, sort_keys=True)
    add_member(state, trajectory(1), 2_000)
    decide(state, 100_000, 12, SETTINGS)
    assert json.dumps(state, default=bytes.hex, sort_keys=True) == snapshot


def test_closed_tombstones_expire_after_retention():
    closed = decide(fill([trajectory(m, float(m)) for m in range(4)]), 5_000, 12, SETTINGS).state
    states = {"g1": closed, "open": fill([trajectory(0, group_id="open")])}
    assert expired_tombstones(states, 5_000 + 3_599_999, SETTINGS) == []
    assert expired_tombstones(states, 5_000 + 3_600_000, SETTINGS) == ["g1"]


def test_counters_accumulate_and_report_dropped_share_over_cap():
    counters = {}
    for counts in ({"emitted": 1, "emitted_complete": 1}, {"dropped": 1, "dropped_stale": 1},
                   {"emitted": 1, "emitted_masked": 1, "masked_members": 2}):
        counters = tally(counters, counts)
    assert counters == {"emitted": 2, "emitted_complete": 1, "dropped": 1, "dropped_stale": 1,
                        "emitted_masked": 1, "masked_members": 2}
    assert dropped_share(counters) == pytest.approx(1 / 3)
    assert dropped_share_exceeded(counters, SETTINGS)
    assert not dropped_share_exceeded({"emitted": 100, "dropped": 5}, SETTINGS)


def test_settings_refuse_a_max_staleness_that_drops_every_stale_pool_group():
    with pytest.raises(ValueError, match="max_staleness"):
        StreamsSettings(max_staleness=20)
