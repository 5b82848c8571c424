"""bench pipeline's pure part: busy fractions from intervals, throughput and staleness of trained
batches, each stage's rate alone from a synchronous run, and the two ratios."""

from __future__ import annotations

import pytest

from pipeline.bench.pipeline_logic import (comparison, learner_intervals, merged, mode_figures, stages_alone,
                                           union_ms)


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


def test_stages_alone_and_the_bound_from_a_synchronous_run(run):
    alone = stages_alone(action_tokens=lambda t: t["tokens"], **{k: v for k, v in run.items() if k != "steps"})
    assert alone["rollout_tokens_per_s"] == pytest.approx(60 / 12)  # 40 tokens in 6 s, 20 in 6 s
    assert alone["learner_tokens_per_s"] == pytest.approx(60 / 7)  # 40 in 3 s, 20 in 4 s
    assert alone["bound_tokens_per_s"] == alone["rollout_tokens_per_s"]


def test_a_run_that_trained_nothing_has_no_figures(run):
    with pytest.raises(ValueError, match="trained nothing"):
        mode_figures(action_tokens=len, **{**run, "weights": run["weights"][:1]})


def test_ratios():
    assert comparison({"trained_tokens_per_s": 2.0}, {"trained_tokens_per_s": 4.5},
                      {"bound_tokens_per_s": 5.0}) == {"ratio": 2.25, "of_bound": 0.9}
