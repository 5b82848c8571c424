"""Batch cutting: credit, minimum, first-batch factor, rounding with whole groups, ids, normalization."""

import pytest

from schemas.arrays import pack_ids, pack_logprobs, pack_mask
from schemas.codec import codec, encode
from streams.advantages import grpo_advantages, task_normalize
from streams.batching import action_tokens, batch_id, build_batch, plan_batch
from streams.settings import StreamsSettings

# batch_size 2 x n 4: min 8 trajectories, first batch ceil(1.7 * 8) = 14
SETTINGS = StreamsSettings(batch_size=2, group_size=4)


def trajectory(group_id, member, reward, mask, task="os"):
    return {
        "trajectory_id": f"{group_id}-{member}", "run": "run", "group_id": group_id, "member": member,
        "group_size": 4, "task": task, "split": "train", "sample_index": 0, "validation": False,
        "input_ids": pack_ids(range(len(mask))), "loss_mask": pack_mask(mask),
        "rollout_logprobs": pack_logprobs([0.0] * len(mask)), "arrays_uri": None, "num_tokens": len(mask),
        "prompt_tokens": 1,
        "turns": [{"turn": 0, "pool": "current", "engine_id": "c0", "weight_version": 3, "start": 1,
                   "length": sum(mask), "generate_ms": 1.0, "env_ms": 1.0}],
        "status": "completed", "reward": reward, "env_reward": reward, "termination": "env_finished",
        "template_fingerprint": "f", "worker_id": "w", "started_at_ms": 0, "finished_at_ms": 1,
        "score": None, "metrics": {},
    }


def group(group_id, rewards=(1.0, 0.0, 1.0, 0.0), masked=(), task="os", masks=None, validation=False):
    masks = masks or [[0, 1, 1, 1]] * len(rewards)
    keep = [m not in masked for m in range(len(rewards))]
    adv = grpo_advantages(rewards, [0] * len(rewards), valid=keep)
    members = [{"trajectory": trajectory(group_id, m, r, masks[m], task), "advantage": float(a), "masked": m in masked}
               for m, (r, a) in enumerate(zip(rewards, adv))]
    return {"group_id": group_id, "run": "run", "task": task, "split": "train", "sample_index": 0,
            "group_size": 4, "validation": validation, "completion": "masked" if masked else "complete",
            "members": members, "reward_mean": 0.5, "reward_std": 0.5, "all_equal": False,
            "min_weight_version": 3, "first_arrival_ms": 0, "last_arrival_ms": 0, "ready_at_ms": 0}


def groups(n):
    return [group(f"g{i}") for i in range(n)]


def test_nothing_is_cut_without_learner_credit():
    plan = plan_batch(groups(10), None, 1, SETTINGS)
    assert not plan.cut and plan.reason == "no credit" and len(plan.remaining) == 10


def test_batch_waits_for_min_trajectories():
    assert not plan_batch(groups(1), 5, 1, SETTINGS).cut
    plan = plan_batch(groups(2), 5, 1, SETTINGS)
    assert plan.cut and plan.trajectories == 8


def test_first_batch_waits_for_one_point_seven_times_the_minimum():
    assert SETTINGS.first_batch_trajectories == 14
    assert not plan_batch(groups(3), 0, 0, SETTINGS).cut  # 12 < 14
    plan = plan_batch(groups(4), 0, 0, SETTINGS)
    assert plan.cut and plan.trajectories == 16


def test_batch_takes_all_ready_trajectories_not_just_the_minimum():
    plan = plan_batch(groups(7), 5, 1, SETTINGS)
    assert plan.cut and plan.trajectories == 28 and plan.remaining == []


def test_trajectory_count_is_rounded_down_to_lcm_of_n_and_data_parallel_size():
    settings = SETTINGS.model_copy(update={"data_parallel_multiple": 8})  # lcm(4, 8) = 8
    plan = plan_batch(groups(5), 5, 1, settings)
    assert plan.trajectories == 16 and [g["group_id"] for g in plan.remaining] == ["g4"]


def test_group_straddling_the_multiple_stays_whole_for_the_next_batch():
    settings = SETTINGS.model_copy(update={"data_parallel_multiple": 8})
    ready = [group("a"), group("b", masked=(3,)), group("c"), group("d")]  # 4 + 3 + 4 + 4 = 15 -> 8
    plan = plan_batch(ready, 5, 1, settings)
    assert [g["group_id"] for g in plan.groups] == ["a", "b"]  # 7 fit under 8; c would straddle it
    assert plan.cut and plan.trajectories == 7 and [g["group_id"] for g in plan.remaining] == ["c", "d"]


def test_masked_members_do_not_count_and_are_not_batched():
    ready = [group("a", masked=(1,)), group("b"), group("c")]  # 3 + 4 + 4 = 11 -> 8: a and b
    plan = plan_batch(ready, 5, 1, SETTINGS)
    assert plan.cut and [g["group_id"] for g in plan.groups] == ["a", "b"] and plan.trajectories == 7
    batch = build_batch("run", 1, 5, plan.groups, SETTINGS, now_ms=9)
    assert len(batch["items"]) == 7
    assert ("a", 1) not in {(i["trajectory"]["group_id"], i["trajectory"]["member"]) for i in batch["items"]}


def test_validation_groups_are_refused():
    with pytest.raises(ValueError, match="validation"):
        plan_batch([group("v", validation=True)], 5, 1, SETTINGS)


def test_batch_id_is_deterministic_and_independent_of_group_order():
    assert batch_id("run", ["b", "a"]) == batch_id("run", ["a", "b"])
    assert batch_id("run", ["a", "b"]) != batch_id("other", ["a", "b"])
    assert batch_id("run", ["a", "b"]) != batch_id("run", ["a", "b", "c"])


def test_batch_has_exactly_the_batch_schema_fields_and_encodes():
    batch = build_batch("run", 3, 5, [group("a"), group("b", task="db")], SETTINGS, now_ms=42)
    assert set(batch) == {f["name"] for f in codec().schema("batch")["fields"]}
    encode("batch", batch)
    assert (batch["index"], batch["credit_version"], batch["created_at_ms"]) == (3, 5, 42)
    assert batch["group_ids"] == ["a", "b"] and batch["batch_id"] == batch_id("run", ["a", "b"])
    assert [s["task"] for s in batch["task_stats"]] == ["db", "os"]


def test_batch_reproduces_the_reference_advantages():
    masks = [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 0]]
    ready = [group("g0", (1, 0), masks=masks[0:2], task="t0"), group("g1", (0.5, 1), masks=masks[2:4], task="t0"),
             group("g2", (0, 1), masks=masks[4:6], task="t1")]
    batch = build_batch("run", 1, 5, ready, SETTINGS, now_ms=0)
    assert [i["advantage"] for i in batch["items"]] == pytest.approx(
        [1.0541, -0.8433, -0.8433, 1.0541, -0.7303, 1.0954], abs=5e-5)
    t0 = batch["task_stats"][0]
    assert (t0["task"], t0["tokens"], t0["trajectories"]) == ("t0", 9, 4)
    assert t0["mean_before"] == pytest.approx(-0.078567, abs=1e-6)
    assert t0["mean_after"] == pytest.approx(0.0, abs=1e-12) and t0["std_after"] == pytest.approx(1.0, abs=1e-5)


def test_offloaded_trajectory_counts_its_action_tokens_from_turn_lengths():
    t = trajectory("g", 0, 1.0, [0, 1, 1, 0, 1])
    offloaded = {**t, "loss_mask": b"", "input_ids": b"", "rollout_logprobs": b"", "arrays_uri": "s3://p/k.npz"}
    assert action_tokens(t) == action_tokens(offloaded) == 3


def test_batch_normalization_is_the_same_function_as_task_normalize():
    ready = [group("a", (1.0, 0.0, 0.0, 0.0), masks=[[1], [1, 1], [1, 1, 1], [0, 1]]), group("b")]
    batch = build_batch("run", 1, 5, ready, SETTINGS, now_ms=0)
    members = [m for g in ready for m in g["members"]]
    final, _ = task_normalize([m["advantage"] for m in members], ["os"] * 8,
                              [[1], [1, 1], [1, 1, 1], [0, 1]] + [[0, 1, 1, 1]] * 4)
    assert [i["advantage"] for i in batch["items"]] == pytest.approx(list(final))
    assert [i["group_advantage"] for i in batch["items"]] == [m["advantage"] for m in members]


def test_later_smaller_group_fills_the_gap_a_straddling_group_leaves():
    settings = SETTINGS.model_copy(update={"data_parallel_multiple": 8})
    ready = [group("a"), group("b", masked=(3,)), group("c"), group("e", masked=(0, 1, 2))]  # 4+3+4+1 = 12 -> 8
    plan = plan_batch(ready, 5, 1, settings)
    assert [g["group_id"] for g in plan.groups] == ["a", "b", "e"] and plan.trajectories == 8
    assert [g["group_id"] for g in plan.remaining] == ["c"]


def test_default_sizes_follow_the_paper_config():
    s = StreamsSettings()
    assert (s.min_trajectories, s.first_batch_trajectories, s.trajectory_multiple) == (2048, 3482, 8)
    assert StreamsSettings(batch_size=1, group_size=10).first_batch_trajectories == 17  # not 18 from 17.000000000000004
    assert StreamsSettings(group_size=8, data_parallel_multiple=6).trajectory_multiple == 24


def test_batch_with_task_adv_norm_off_trains_on_the_group_advantages_unchanged():
    ready = [group("a", (1.0, 0.0, 0.5, 0.0), masks=[[1], [1, 1], [1, 1, 1], [0, 1]]), group("b", task="db")]
    off = build_batch("run", 1, 5, ready, SETTINGS.model_copy(update={"task_adv_norm": False}), now_ms=0)
    on = build_batch("run", 1, 5, ready, SETTINGS, now_ms=0)
    grpo = [m["advantage"] for g in ready for m in g["members"]]
    assert [i["advantage"] for i in off["items"]] == [i["group_advantage"] for i in off["items"]] == grpo
    assert [i["advantage"] for i in on["items"]] != grpo
    assert [s["tokens"] for s in off["task_stats"]] == [s["tokens"] for s in on["task_stats"]]


def test_the_paper_ablations_are_off_by_default():
    s = StreamsSettings()
    assert (s.task_adv_norm, s.routing_mode, s.stale_ratio) == (True, "turn", 0.25)
    with pytest.raises(ValueError):
        StreamsSettings(routing_mode="episode")
