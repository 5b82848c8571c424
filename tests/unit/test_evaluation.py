"""Evaluation statistics (pipeline/analysis/evaluation.py) on hand-made trajectories with hand-computed answers."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest

from pipeline.analysis import evaluation
from pipeline.analysis.evaluation import (
    before_after,
    dedup,
    MIN_PAIRED_SAMPLES,
    is_success,
    paired_change,
    paired_decision,
    repeat_table,
    sign_flip_p_value,
    success_by_task,
    termination_shares,
    two_proportion_p_value,
    validation_rounds,
    wilson_interval,
)
from schemas.ids import group_id, trajectory_id

RUN = "eval-run"


def traj(task: str, success: bool, *, member: int = 0, sample: int = 0, epoch: int = 0, split: str = "dev",
         status: str | None = None, reward: float | None = None, validation: bool = True) -> dict[str, Any]:
    """The fields of a trajectory event that evaluation reads (schemas/avro/trajectory.avsc names)."""
    gid = group_id(RUN, task, split, sample, epoch)
    status = status or "completed"
    env_reward = 1.0 if success else 0.0
    return {"trajectory_id": trajectory_id(RUN, gid, member), "run": RUN, "group_id": gid, "member": member,
            "task": task, "split": split, "sample_index": sample, "validation": validation, "status": status,
            "env_reward": env_reward, "reward": env_reward if reward is None else reward}


def round_of(task: str, epoch: int, successes: int, episodes: int, samples: int = 5) -> list[dict[str, Any]]:
    """`episodes` validation trajectories of one round (samples x members), the first `successes` successful."""
    members = episodes // samples
    return [traj(task, k < successes, member=k % members, sample=k // members, epoch=epoch) for k in range(episodes)]


@pytest.mark.parametrize(("successes", "n", "expected"), [
    (0, 10, (0.0, 0.2775)), (5, 10, (0.2366, 0.7634)), (10, 10, (0.7225, 1.0)), (3, 8, (0.1368, 0.6943)),
])
def test_wilson_interval_matches_published_values(successes: int, n: int, expected: tuple[float, float]) -> None:
    lo, hi = wilson_interval(successes, n)
    assert (round(lo, 4), round(hi, 4)) == expected


def test_wilson_interval_widens_with_confidence_and_knows_nothing_without_episodes() -> None:
    lo95, hi95 = wilson_interval(5, 10)
    lo99, hi99 = wilson_interval(5, 10, confidence=0.99)
    assert lo99 < lo95 and hi99 > hi95
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_success_needs_completed_status_and_full_credit() -> None:
    assert is_success(traj("calc", True))
    assert not is_success(traj("calc", False))
    assert not is_success({**traj("calc", True), "status": "task_limit_reached"})
    assert not is_success({**traj("calc", True), "env_reward": 0.99})


def test_duplicate_trajectory_is_counted_once() -> None:
    t = traj("calc", True)
    assert dedup([t, dict(t), traj("calc", False, member=1)]) == [t, traj("calc", False, member=1)]


def test_success_by_task_counts_episodes_rate_interval_and_mean_reward() -> None:
    trajs = [traj("calc", True), traj("calc", False, member=1, reward=-0.2, status="task_limit_reached"),
             traj("db", False)]
    table = success_by_task(trajs)
    assert table["calc"]["episodes"] == 2 and table["calc"]["successes"] == 1
    assert table["calc"]["success_rate"] == 0.5
    assert table["calc"]["mean_reward"] == pytest.approx(0.4)
    assert table["calc"]["ci95"] == list(wilson_interval(1, 2))
    assert table["db"]["success_rate"] == 0.0


def test_repeat_table_is_mean_and_std_over_member_repeats() -> None:
    # 4 samples x 3 repeats; repeat 0 succeeds on 4/4, repeat 1 on 2/4, repeat 2 on 0/4
    wins = {0: 4, 1: 2, 2: 0}
    trajs = [traj("os", sample < wins[m], member=m, sample=sample) for sample in range(4) for m in range(3)]
    row = repeat_table(trajs)["os"]
    assert row["rates"] == [1.0, 0.5, 0.0]
    assert row["episodes"] == [4, 4, 4]
    assert row["mean"] == pytest.approx(0.5)
    assert row["std"] == pytest.approx(0.5)  # sample std of (1, 0.5, 0)


def test_termination_shares_sum_to_one_per_task_and_overall() -> None:
    trajs = [traj("calc", True), traj("calc", False, member=1, status="task_limit_reached"),
             traj("calc", False, member=2, status="agent_invalid_action"), traj("calc", True, member=3),
             traj("db", False, status="task_error")]
    shares = termination_shares(trajs)
    assert shares["tasks"]["calc"]["shares"] == {"completed": 0.5, "agent_invalid_action": 0.25,
                                                 "task_limit_reached": 0.25}
    assert shares["tasks"]["db"]["shares"] == {"task_error": 1.0}
    assert shares["overall"]["episodes"] == 5 and shares["overall"]["shares"]["completed"] == pytest.approx(0.4)
    for row in (*shares["tasks"].values(), shares["overall"]):
        assert math.fsum(row["shares"].values()) == pytest.approx(1.0)


def test_validation_round_is_recovered_from_the_group_id_when_not_given() -> None:
    trajs = round_of("calc", 0, 1, 4, samples=2) + round_of("calc", 3, 1, 4, samples=2)
    rounds = validation_rounds(trajs)
    assert sorted(set(rounds.values())) == [0, 3]
    given = validation_rounds(trajs, {trajs[0]["group_id"]: 7})
    assert given[trajs[0]["group_id"]] == 7
    foreign = {**trajs[0], "group_id": "not-a-rollstream-group"}
    assert validation_rounds([foreign], max_round=50) == {}


def test_disjoint_intervals_mean_improved_overlapping_mean_no_clear_change() -> None:
    trajs = (round_of("calc", 0, 2, 20) + round_of("calc", 1, 10, 20) + round_of("calc", 2, 18, 20)
             + round_of("db", 0, 5, 20) + round_of("db", 2, 6, 20)
             + round_of("kg", 0, 19, 20) + round_of("kg", 2, 3, 20))
    table = before_after(trajs)
    calc = table["calc"]
    assert calc["before"] == {"round": 0, "episodes": 20, "successes": 2, "rate": 0.1,
                              "ci95": list(wilson_interval(2, 20))}
    assert calc["after"]["round"] == 2 and calc["after"]["successes"] == 18  # the middle round is skipped
    assert calc["verdict"] == "improved" and calc["intervals_disjoint"]
    assert calc["p_value"] < 1e-5
    assert table["db"]["verdict"] == "no clear change" and not table["db"]["intervals_disjoint"]
    assert table["db"]["p_value"] == pytest.approx(0.7233, abs=1e-4)
    assert table["kg"]["verdict"] == "worse"
    assert {row["criterion"] for row in table.values()} == {"disjoint intervals"}  # 5 samples: too few to pair


def test_a_single_validation_round_has_no_after_and_no_verdict() -> None:
    row = before_after(round_of("calc", 0, 3, 8, samples=2))["calc"]
    assert row["after"] is None and row["p_value"] is None
    assert row["verdict"] == "not evaluated after training"


def test_training_trajectories_never_enter_before_after() -> None:
    assert before_after([traj("calc", True, validation=False)]) == {}


def test_two_proportion_test_is_undefined_without_any_variation() -> None:
    assert two_proportion_p_value(10, 10, 10, 10) == 1.0
    assert two_proportion_p_value(0, 0, 3, 10) == 1.0


def paired_rounds(task: str, wins_before: list[int], wins_after: list[int], repeats: int = 2) -> list[dict[str, Any]]:
    """Rounds 0 and 1 over the same samples; sample i succeeds in the first wins[i] of its repeats."""
    return [traj(task, member < wins[sample], member=member, sample=sample, epoch=epoch)
            for epoch, wins in ((0, wins_before), (1, wins_after))
            for sample in range(len(wins)) for member in range(repeats)]


def test_a_change_the_same_samples_share_is_clear_when_paired_though_the_rounds_intervals_overlap() -> None:
    # 40 samples x 2 repeats: 20 always solved, 20 never; afterwards 10 of the unsolved are solved once.
    before, after = [2] * 20 + [0] * 20, [2] * 20 + [1] * 10 + [0] * 10
    row = before_after(paired_rounds("calc", before, after))["calc"]
    assert (row["before"]["successes"], row["after"]["successes"]) == (40, 50)
    assert not row["intervals_disjoint"]  # [39.2%, 60.8%] vs [51.6%, 72.3%]
    # per-sample changes: ten of +0.5, thirty of 0: mean 0.125, sample std 0.21926, half width 1.96 x 0.21926 / sqrt(40)
    change = row["change"]
    assert (change["samples"], change["up"], change["down"]) == (40, 10, 0)
    assert change["mean"] == pytest.approx(0.125)
    assert change["ci95"] == pytest.approx([0.05705, 0.19295], abs=1e-4)
    assert row["criterion"] == "paired change" and row["verdict"] == "improved"


def test_changes_that_cancel_across_samples_are_no_clear_change() -> None:
    # as many samples fall as rise: the mean change is zero whatever the per-round counts
    before, after = [2] * 20 + [0] * 20, [0] * 10 + [2] * 10 + [2] * 10 + [0] * 10
    row = before_after(paired_rounds("calc", before, after))["calc"]
    assert row["change"]["mean"] == 0.0 and (row["change"]["up"], row["change"]["down"]) == (10, 10)
    assert row["verdict"] == "no clear change"


def test_a_policy_that_never_succeeds_shows_no_change_and_no_spread() -> None:
    row = before_after(paired_rounds("os", [0] * 40, [0] * 40))["os"]
    assert row["change"]["ci95"] == [0.0, 0.0] and row["verdict"] == "no clear change"


def test_only_samples_evaluated_in_both_rounds_are_paired() -> None:
    before = [traj("calc", True, sample=i, epoch=0) for i in range(4)]
    after = [traj("calc", i % 2 == 0, sample=i, epoch=1) for i in range(2, 6)]
    change = paired_change(before, after)
    assert change["samples"] == 2 and change["down"] == 1 and change["mean"] == pytest.approx(-0.5)
    assert paired_change(before[:1], after) is None  # no pair: nothing to measure
    assert MIN_PAIRED_SAMPLES > change["samples"]


def test_five_samples_up_and_none_down_of_a_hundred_is_no_clear_change_though_the_interval_excludes_zero() -> None:
    # The normal interval of the mean change lies above zero, but five signs are five coin tosses: p = 2/32.
    before, after = [0] * 100, [1] * 5 + [0] * 95
    row = before_after(paired_rounds("db", before, after))["db"]
    change = row["change"]
    assert change["ci95"][0] > 0 and (change["up"], change["down"]) == (5, 0)
    assert change["p_sign_flip"] == pytest.approx(2 / 32)
    assert row["criterion"] == "paired change" and row["verdict"] == "no clear change"


def test_the_sign_flip_p_value_counts_every_sign_assignment_exactly() -> None:
    quarter = Fraction(1, 4)
    assert sign_flip_p_value([]) == 1.0 and sign_flip_p_value([Fraction(0)] * 3) == 1.0
    # +1/4, +1/4, +1/2 (sum 1): of the 8 assignments, +-1 only when all signs agree: 2/8
    assert sign_flip_p_value([quarter, quarter, 2 * quarter]) == pytest.approx(2 / 8)
    # +1/2, -1/4: sums +-1/4 and +-3/4; |sum| >= 1/4 always
    assert sign_flip_p_value([2 * quarter, -quarter]) == 1.0
    # shares of different repeats (thirds and halves) share a denominator: +1/3, +1/2 -> 2/4 reach |5/6|
    assert sign_flip_p_value([Fraction(1, 3), Fraction(1, 2)]) == pytest.approx(2 / 4)
    # ten samples all up: 2 / 2^10
    assert sign_flip_p_value([quarter] * 10) == pytest.approx(2 / 1024)


def test_a_change_both_the_interval_and_the_sign_flip_test_see_is_improved_or_worse() -> None:
    assert paired_decision({"ci95": [0.01, 0.2], "p_sign_flip": 0.001}) == "improved"
    assert paired_decision({"ci95": [-0.2, -0.01], "p_sign_flip": 0.001}) == "worse"
    assert paired_decision({"ci95": [0.01, 0.2], "p_sign_flip": 0.06}) is None
    assert paired_decision({"ci95": [-0.01, 0.2], "p_sign_flip": 0.001}) is None
    assert paired_decision({"ci95": [0.01, 0.2]}) == "improved"  # recorded before the test existed


def test_the_sign_flip_test_of_many_samples_of_varying_repeats_is_quick_and_agrees_with_the_exact_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    # 1,000 samples, repeats 1-8 (common denominator 840): the exact count would take minutes.
    changes = [Fraction((i % 3) - 1 + (i % 7 == 0), 1 + i % 8) for i in range(1000)]
    started = time.perf_counter()
    p = sign_flip_p_value(changes)
    assert time.perf_counter() - started < 1.0 and 0.0 <= p <= 1.0
    # Where both apply, the approximation is close to the count once continuity-corrected (the sums lie two
    # quarters apart, so |sum| >= 20 quarters begins at 19): 60 samples of quarters, 20 up more than down; exact
    # 0.0135, corrected 0.0142, uncorrected 0.0098.
    quarters = [Fraction(1, 4)] * 40 + [Fraction(-1, 4)] * 20
    exact = sign_flip_p_value(quarters)
    assert exact == pytest.approx(math.erfc(19 / math.sqrt(2 * 60)), abs=0.001)
    assert exact > math.erfc(20 / math.sqrt(2 * 60)) + 0.003  # uncorrected, the approximation claims too much
    monkeypatch.setattr(evaluation, "EXACT_SIGN_FLIP_WORK", 0)  # the approximation's branch on the same changes
    assert sign_flip_p_value(quarters) == pytest.approx(exact, abs=0.001)
