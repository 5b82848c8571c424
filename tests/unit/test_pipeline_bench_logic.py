"""bench pipeline's pure part: busy fractions from intervals, throughput and staleness of trained
batches over a warm window, each stage's rate alone, and a bound no perfect overlap can beat."""

from __future__ import annotations

import pytest

from pipeline.bench.pipeline_logic import (bound, comparison, learner_alone, learner_intervals, merged, mode_figures,
                                           rollout_alone, union_ms)


def test_overlapping_intervals_count_once():
    assert union_ms([(0, 10), (5, 15), (20, 25)]) == 20
    assert merged([(20, 25), (0, 10), (5, 15), (15, 16)]) == [(0, 16), (20, 25)]
    assert union_ms([]) == 0


def _metric(step: int, name: str, value: float, at_ms: int) -> dict:
    return {"source": "learner", "name": name, "value": value, "step": step, "at_ms": at_ms}


def _traj(tokens: int, versions: list[int]) -> dict:
    return {"tokens": tokens, "turns": [{"weight_version": v} for v in versions]}


@pytest.fixture
def run() -> dict:
    """Two synchronous steps: dispatch at 0 and 10 s, batches cut at 6 and 16 s, steps of 3 s."""
    requested = [{"group_id": "g1", "dispatched_at_ms": 0}, {"group_id": "g2", "dispatched_at_ms": 10_000}]
    batches = [{"batch_id": "b1", "group_ids": ["g1"], "created_at_ms": 6_000,
                "items": [{"trajectory": _traj(30, [0, 0])}, {"trajectory": _traj(10, [0])}]},
               {"batch_id": "b2", "group_ids": ["g2"], "created_at_ms": 16_000,
                "items": [{"trajectory": _traj(20, [1])}]}]
    weights = [{"version": 0, "batch_id": None, "published_at_ms": 0},
               {"version": 1, "batch_id": "b1", "published_at_ms": 9_000},
               {"version": 2, "batch_id": "b2", "published_at_ms": 20_000}]
    metrics = [_metric(1, "timing/ref_s", 1.0, 9_000), _metric(1, "timing/actor_s", 1.5, 9_000),
               _metric(1, "timing/publish_s", 0.5, 9_000), _metric(1, "actor/loss", 9.0, 9_000),
               _metric(2, "timing/actor_s", 4.0, 20_000)]
    steps = [{"engine_id": "e1", "started_at_ms": 1_000, "generate_ms": 2_000.0},
             {"engine_id": "e1", "started_at_ms": 2_000, "generate_ms": 2_000.0},
             {"engine_id": "e2", "started_at_ms": 11_000, "generate_ms": 1_000.0}]
    return dict(requested=requested, batches=batches, weights=weights, metrics=metrics, steps=steps)


def test_learner_busy_is_ref_actor_and_publish_ending_at_the_metrics():
    assert learner_intervals([_metric(3, "timing/ref_s", 1.0, 10_000), _metric(3, "timing/actor_s", 2.0, 10_000),
                              _metric(3, "actor/loss", 5.0, 10_000)]) == {3: (7_000, 10_000)}


def test_mode_figures_from_trained_batches(run):
    f = mode_figures(action_tokens=lambda t: t["tokens"], **run)
    assert f["wall_s"] == 20 and f["learner_steps"] == 2 and f["trained_tokens"] == 60
    assert f["trained_tokens_per_s"] == 3.0 and f["trajectories_per_s"] == 3 / 20
    assert f["engine_busy"] == pytest.approx((3_000 + 1_000) / (2 * 20_000))
    assert f["learner_busy"] == pytest.approx(7_000 / 20_000)
    assert f["mean_staleness"] == 0.0  # every turn on the version just before the one it trained into


def test_the_warm_up_steps_fall_outside_the_window(run):
    f = mode_figures(action_tokens=lambda t: t["tokens"], warmup_steps=1, **run)
    # from version 1's publication (9 s) to version 2's (20 s): batch b2 alone, its 20 tokens
    assert f["wall_s"] == 11 and f["learner_steps"] == 1 and f["trained_tokens"] == 20
    assert f["trained_tokens_per_s"] == pytest.approx(20 / 11)
    assert f["engine_busy"] == pytest.approx(1_000 / (2 * 11_000))  # e1's cold generation is before it
    assert f["learner_busy"] == pytest.approx(4_000 / 11_000)


def test_a_run_that_did_not_finish_its_warm_up_has_no_figures(run):
    with pytest.raises(ValueError, match="trained nothing after its warm-up"):
        mode_figures(action_tokens=len, warmup_steps=2, **run)
    with pytest.raises(ValueError, match="did not finish its 1 warm-up steps"):
        mode_figures(action_tokens=len, warmup_steps=1, **{**run, "weights": [run["weights"][0], run["weights"][2]]})


def test_the_learner_alone_is_its_measured_steps_tokens_over_their_busy_time(run):
    alone = learner_alone(action_tokens=lambda t: t["tokens"], warmup_steps=0,
                          **{k: v for k, v in run.items() if k not in ("steps", "requested")})
    assert alone["learner_tokens_per_s"] == pytest.approx(60 / 7)  # 40 in 3 s, 20 in 4 s
    assert alone["learner_trajectories_per_s"] == pytest.approx(3 / 7)
    warm = learner_alone(action_tokens=lambda t: t["tokens"], warmup_steps=1,
                         **{k: v for k, v in run.items() if k not in ("steps", "requested")})
    assert warm["learner_tokens_per_s"] == pytest.approx(20 / 4)


def _ready(at_s: list[float], tokens: int = 10, masked: int = 0) -> list[dict]:
    """Training groups of two members, ready at these times; `masked` of each group's members masked."""
    return [{"group_id": f"g{i}", "validation": False, "ready_at_ms": int(at * 1000),
             "members": [{"trajectory": _traj(tokens // 2, [0]), "masked": m < masked} for m in range(2)]}
            for i, at in enumerate(at_s)]


def test_the_rollout_alone_starts_after_the_warm_up_groups():
    # two cold groups late (at 20 s), then one every 2 s; two more queued behind the measured three
    groups = _ready([20, 20.5, 22.5, 24.5, 26.5, 27, 27.5])
    read_twice = list(reversed(groups)) + groups[:3]
    alone = rollout_alone(groups=read_twice, action_tokens=lambda t: t["tokens"], skip=2, measured=3)
    assert alone["rollout_window_s"] == 6 and alone["rollout_tokens_per_s"] == pytest.approx(30 / 6)
    assert alone["rollout_trajectories_per_s"] == pytest.approx(6 / 6)
    with pytest.raises(ValueError, match="7 groups ready, 5 \\+ 3 needed"):
        rollout_alone(groups=groups, action_tokens=len, skip=5, measured=3)


def test_masked_members_are_not_trainable_rollout_work():
    alone = rollout_alone(groups=_ready([1, 2, 3], masked=1), action_tokens=lambda t: t["tokens"], skip=1, measured=2)
    assert alone["rollout_tokens_per_s"] == pytest.approx(10 / 2) and alone["rollout_trajectories_per_s"] == 1


def test_the_bound_is_the_slower_stage():
    b = bound({"rollout_tokens_per_s": 5.0, "rollout_trajectories_per_s": 1.0},
              {"learner_tokens_per_s": 8.0, "learner_trajectories_per_s": 0.5})
    assert b["bound_tokens_per_s"] == 5.0 and b["bound_trajectories_per_s"] == 0.5


def _perfect_overlap(rollout_s: float, learner_s: float, batches: int, tokens: int) -> dict:
    """An asynchronous run whose stages overlap perfectly at their rates alone: batch k is cut at
    k * rollout_s (rollouts never wait), and the learner trains each batch for learner_s as soon as
    it is cut and the previous step is done."""
    requested = [{"group_id": f"g{k}", "dispatched_at_ms": 0, "validation": False} for k in range(batches)]
    cut_batches, weights, metrics = [], [{"version": 0, "batch_id": None, "published_at_ms": 0}], []
    done = 0.0
    for k in range(1, batches + 1):
        cut = k * rollout_s
        done = max(cut, done) + learner_s
        cut_batches.append({"batch_id": f"b{k}", "index": k, "group_ids": [f"g{k}"], "created_at_ms": int(cut * 1000),
                            "items": [{"trajectory": _traj(tokens // 2, [k - 1])} for _ in range(2)]})
        weights.append({"version": k, "batch_id": f"b{k}", "published_at_ms": int(done * 1000)})
        metrics.append(_metric(k, "timing/actor_s", learner_s, int(done * 1000)))
    return dict(requested=requested, steps=[], batches=cut_batches, weights=weights, metrics=metrics)


@pytest.mark.parametrize("rollout_s,learner_s", [(2.0, 3.0), (3.0, 2.0), (2.5, 2.5), (0.4, 7.0), (7.0, 0.4)])
def test_a_perfect_overlap_of_the_measured_stages_reaches_the_bound_and_never_beats_it(rollout_s, learner_s):
    tokens = 60
    run = _perfect_overlap(rollout_s, learner_s, batches=12, tokens=tokens)

    def count(t: dict) -> int:
        return t["tokens"]

    async_ = mode_figures(action_tokens=count, warmup_steps=2, **run)
    # the stages alone at the same rates: a learner timed step by step, rollouts cut every rollout_s
    learner = learner_alone(action_tokens=count, warmup_steps=2,
                            **{k: v for k, v in run.items() if k in ("batches", "weights", "metrics")})
    rollout = rollout_alone(groups=_ready([k * rollout_s for k in range(1, 13)], tokens=tokens),
                            action_tokens=count, skip=2, measured=8)
    result = comparison({"trained_tokens_per_s": 1.0}, async_, bound(rollout, learner))
    assert result["of_bound"] == pytest.approx(1.0, abs=1e-3)
    assert result["of_bound"] <= 1.0 + 1e-3 and result["of_bound_trajectories"] <= 1.0 + 1e-3


def test_a_run_that_trained_nothing_has_no_figures(run):
    with pytest.raises(ValueError, match="trained nothing"):
        mode_figures(action_tokens=len, **{**run, "weights": run["weights"][:1]})


def test_ratios():
    assert comparison({"trained_tokens_per_s": 2.0}, {"trained_tokens_per_s": 4.5, "trajectories_per_s": 1.5},
                      {"bound_tokens_per_s": 5.0, "bound_trajectories_per_s": 2.0}) == \
        {"ratio": 2.25, "of_bound": 0.9, "of_bound_trajectories": 0.75}
