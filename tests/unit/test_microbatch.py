"""Micro-batch packing by token budget and next-token alignment."""

from __future__ import annotations

import numpy as np
import pytest

from learner.microbatch import collate, make_micro_batches, plan_micro_batches, split_updates


def item(n: int, actions: slice = slice(None), advantage: float = 1.0):
    ids = np.arange(10, 10 + n, dtype=np.int32)
    mask = np.zeros(n, dtype=np.uint8)
    mask[actions] = 1
    mask[0] = 0
    logprobs = np.where(mask == 1, -0.1 * np.arange(n), 0.0).astype(np.float32)
    return ids, mask, logprobs, advantage


@pytest.mark.parametrize("budget", [1, 7, 16, 33, 100, 1000])
def test_packing_respects_the_budget_and_loses_no_sequence(budget):
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(2, 60, size=40)]
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for members in plan for i in members) == list(range(len(lengths)))
    for members in plan:
        padded = len(members) * max(lengths[i] for i in members)
        assert padded <= budget or len(members) == 1


def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch():
    plan = plan_micro_batches([5, 50, 5, 5], 20)
    assert [1] in plan
    assert sorted(len(members) for members in plan) == [1, 3]


def test_packing_is_deterministic_longest_first_ties_by_position():
    assert plan_micro_batches([3, 5, 3, 5, 2], 10) == [[1, 3], [0, 2, 4]]
    assert plan_micro_batches([3, 5, 3, 5, 2], 10) == plan_micro_batches([3, 5, 3, 5, 2], 10)


def test_collate_right_pads_and_shifts_labels_masks_and_logprobs_by_one():
    short = item(4, actions=slice(2, 4), advantage=0.5)
    long = item(6, actions=slice(3, 5), advantage=-2.0)
    mb = collate([short, long], [1, 0], pad_token_id=0)
    assert mb.indices == (1, 0)
    assert mb.input_ids.shape == (2, 6) and mb.loss_mask.shape == (2, 5)
    np.testing.assert_array_equal(mb.input_ids[1], [10, 11, 12, 13, 0, 0])
    np.testing.assert_array_equal(mb.attention_mask[1], [1, 1, 1, 1, 0, 0])
    # position t refers to token t+1: tokens 2 and 3 of `short` are actions -> positions 1 and 2
    np.testing.assert_array_equal(mb.loss_mask[1], [0, 1, 1, 0, 0])
    np.testing.assert_allclose(mb.rollout_logprobs[1], [0, -0.2, -0.3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(mb.advantages[1], [0, 0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(mb.loss_mask[0], [0, 0, 1, 1, 0])
    np.testing.assert_allclose(mb.advantages[0], [0, 0, -2.0, -2.0, 0])
    assert mb.action_tokens == 4


def test_first_token_cannot_be_an_action():
    ids, mask, logprobs, adv = item(4)
    mask = mask.copy()
    mask[0] = 1
    with pytest.raises(ValueError, match="token 0"):
        collate([(ids, mask, logprobs, adv)], [0])


def test_mismatched_array_lengths_are_rejected():
    ids, mask, logprobs, adv = item(4)
    with pytest.raises(ValueError, match="differ in length"):
        collate([(ids, mask[:3], logprobs, adv)], [0])


def test_micro_batches_keep_every_action_token():
    items = [item(n, actions=slice(n // 2, None)) for n in (9, 3, 12, 4, 4, 20)]
    micro_batches = make_micro_batches(items, 24)
    expected = sum(int(m[1].sum()) for m in items)
    assert sum(mb.action_tokens for mb in micro_batches) == expected
    assert sorted(i for mb in micro_batches for i in mb.indices) == list(range(len(items)))


def test_shared_prompts_pack_one_prompt_per_micro_batch_and_mark_its_shared_prefix():
    def item(prompt: list[int], tail: list[int]):
        ids = np.array(prompt + tail)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(tail))].astype(np.uint8)
        return ids, mask, np.zeros(len(ids), np.float32), 1.0

    a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6]
    items = [item(a, [10, 11]), item(b, [12]), item(a, [13, 14, 15]), item(b, [16, 17]), item(a + [99], [18])]
    micro = make_micro_batches(items, 10_000, share_prompts=True)
    # Keyed by the whole prompt: the third a-prompt item has a longer prompt (a + [99]) and packs alone.
    assert sorted(sorted(mb.indices) for mb in micro) == [[0, 2], [1, 3], [4]]
    prefix = {tuple(sorted(mb.indices)): mb.prefix_len for mb in micro}
    # Rows share the prompt; the prefix stops one short of it, where the logits predict the first action token.
    assert prefix == {(0, 2): 4, (1, 3): 3, (4,): 0}
    assert all(mb.prefix_len == 0 for mb in make_micro_batches(items, 10_000))


def test_updates_split_the_batch_in_order_into_runs_differing_by_at_most_one():
    items = [(np.zeros(4, np.int32), np.zeros(4, np.uint8), np.zeros(4, np.float32), float(i)) for i in range(7)]
    runs = split_updates(items, 3)
    assert [[item[3] for item in run] for run in runs] == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_updates(items, 1) == [items]
    with pytest.raises(ValueError, match="cannot split a batch of 7 trajectories into 8 updates"):
        split_updates(items, 8)
