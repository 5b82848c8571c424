"""GRPO and per-task token-weighted normalization against the issue's reference values and edge cases."""

import numpy as np
import pytest

from streams.advantages import grpo_advantages, task_normalize, task_normalize_counts

REWARDS = [1, 0, 0.5, 1, 0, 1]
GROUPS = [0, 0, 1, 1, 2, 2]
TASKS = [0, 0, 0, 0, 1, 1]
MASKS = [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 0]]
SIGNS = np.array([1, -1, -1, 1, -1, 1])


def test_grpo_bessel_matches_reference():
    adv = grpo_advantages(REWARDS, GROUPS)
    np.testing.assert_allclose(adv, 0.707106 * SIGNS, atol=2e-6)


def test_grpo_population_matches_reference():
    adv = grpo_advantages(REWARDS, GROUPS, std="population")
    np.testing.assert_allclose(adv, 0.999998 * SIGNS, atol=1e-5)


def test_task_normalization_bessel_matches_reference_stats_and_final():
    final, stats = task_normalize(grpo_advantages(REWARDS, GROUPS), TASKS, MASKS)
    assert stats[0].tokens == 9 and stats[1].tokens == 5
    assert stats[0].trajectories == 4 and stats[1].trajectories == 2
    assert stats[0].mean_before == pytest.approx(-0.078567, abs=1e-6)
    assert stats[0].std_before == pytest.approx(0.745354, abs=1e-6)
    assert stats[1].mean_before == pytest.approx(-0.141421, abs=1e-6)
    assert stats[1].std_before == pytest.approx(0.774596, abs=1e-6)
    np.testing.assert_allclose(final, [1.0541, -0.8433, -0.8433, 1.0541, -0.7303, 1.0954], atol=5e-5)


def test_task_normalization_population_matches_reference_final():
    adv = grpo_advantages(REWARDS, GROUPS, std="population")
    final, _ = task_normalize(adv, TASKS, MASKS, std="population")
    np.testing.assert_allclose(final, [1.1180, -0.8944, -0.8944, 1.1180, -0.8165, 1.2247], atol=5e-5)


def test_normalized_tokens_have_zero_mean_and_unit_std_per_task():
    _, stats = task_normalize(grpo_advantages(REWARDS, GROUPS), TASKS, MASKS)
    for s in stats.values():
        assert s.mean_after == pytest.approx(0.0, abs=1e-12)
        assert s.std_after == pytest.approx(1.0, abs=1e-5)


def test_token_weighting_equals_expanding_every_action_token():
    rng = np.random.default_rng(0)
    adv = rng.normal(size=5)
    masks = [rng.integers(0, 2, size=7) for _ in range(5)]
    final, stats = task_normalize(adv, ["t"] * 5, masks)
    tokens = np.concatenate([np.full(int(m.sum()), a) for a, m in zip(adv, masks)])
    assert stats["t"].mean_before == pytest.approx(tokens.mean())
    assert stats["t"].std_before == pytest.approx(tokens.std(ddof=1))
    np.testing.assert_allclose(final, (adv - tokens.mean()) / (tokens.std(ddof=1) + 1e-6))


def test_group_of_one_uses_mean_zero_and_std_one():
    adv = grpo_advantages([0.7, 1.0, 0.0], ["a", "b", "b"])
    assert adv[0] == pytest.approx(0.7 / (1 + 1e-6))
    assert grpo_advantages([0.7], ["a"], std="population")[0] == pytest.approx(0.7 / (1 + 1e-6))


def test_all_equal_rewards_give_zero_advantage():
    np.testing.assert_array_equal(grpo_advantages([0.5] * 8, [0] * 8), np.zeros(8))


def test_masked_members_get_zero_and_do_not_move_the_group_stats():
    adv = grpo_advantages([1, 0, -0.2, 1], [0, 0, 0, 0], valid=[True, True, False, True])
    np.testing.assert_allclose(adv[[0, 1, 3]], grpo_advantages([1, 0, 1], [0, 0, 0]))
    assert adv[2] == 0.0


def test_task_with_one_trajectory_in_batch_gets_zero_final_advantage():
    final, stats = task_normalize([0.7, -0.7, 1.3], ["a", "a", "b"], [[1, 1], [1, 0], [0, 1, 1, 1]])
    assert final[2] == 0.0
    assert stats["b"].tokens == 3 and stats["b"].mean_before == pytest.approx(1.3) and stats["b"].std_before == 0.0


def test_task_with_a_single_action_token_has_std_zero_not_nan():
    final, stats = task_normalize([0.4], ["a"], [[0, 0, 1]])
    assert stats["a"].std_before == 0.0 and stats["a"].tokens == 1
    assert final[0] == 0.0


def test_task_without_action_tokens_reports_zero_stats():
    final, stats = task_normalize_counts([0.5, -0.5], ["a", "a"], [0, 0])
    assert (stats["a"].tokens, stats["a"].mean_before, stats["a"].std_before) == (0, 0.0, 0.0)
    np.testing.assert_array_equal(final, [0.0, 0.0])


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError):
        grpo_advantages([1, 0], [0])
    with pytest.raises(ValueError):
        task_normalize_counts([1.0], ["a", "b"], [1, 1])


def test_with_task_adv_norm_off_the_final_advantages_are_the_grpo_ones():
    grpo = grpo_advantages(REWARDS, GROUPS)
    final, stats = task_normalize(grpo, TASKS, MASKS, normalize=False)
    np.testing.assert_array_equal(final, grpo)
    normalized, _ = task_normalize(grpo, TASKS, MASKS)
    assert not np.allclose(normalized, grpo)  # the switch changes something at all
    for s in stats.values():  # the statistics are still reported, unchanged by the (skipped) step
        assert (s.mean_after, s.std_after) == (s.mean_before, s.std_before)
    assert stats[0].tokens == 9 and stats[0].mean_before == pytest.approx(-0.078567, abs=1e-6)
