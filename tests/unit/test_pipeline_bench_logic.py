"""bench pipeline's pure part: busy fractions from intervals, throughput and staleness of trained
batches over a warm window, each stage's rate alone, and a bound no perfect overlap can beat except
by the noise of the stages alone."""

from __future__ import annotations

import itertools

import pytest

from pipeline.bench.pipeline import ALONE, mode_config
from pipeline.bench.pipeline_logic import (bound, bound_warnings, comparison, cores_bound, cpu_between,
                                           learner_alone, learner_intervals, merged, mode_figures,
                                           replay_differences, replay_order, rollout_alone, stage_cpu, union_ms)
from pipeline.run.config import REPO_ROOT, load_config


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
    assert alone["learner_fastest_tokens_per_s"] == pytest.approx(40 / 3) and alone["learner_steps"] == 2
    assert alone["learner_fastest_trajectories_per_s"] == pytest.approx(2 / 3)
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
    assert alone["rollout_fastest_tokens_per_s"] == alone["rollout_tokens_per_s"]  # one chunk: the window
    with pytest.raises(ValueError, match="7 groups ready, 5 \\+ 3 needed"):
        rollout_alone(groups=groups, action_tokens=len, skip=5, measured=3)


def test_the_fastest_rollout_is_the_fastest_batch_of_groups_in_the_window():
    # warm-up group at 10 s; batches of two groups: 10-14 s, 14-15 s, then two groups at once (left
    # out: no span), and the last group, short of a batch, left out as well
    groups = _ready([10, 12, 14, 14.5, 15, 16, 16, 17])
    alone = rollout_alone(groups=groups, action_tokens=lambda t: t["tokens"], skip=1, measured=7, per_batch=2)
    assert alone["rollout_tokens_per_s"] == pytest.approx(70 / 7)
    assert alone["rollout_fastest_tokens_per_s"] == pytest.approx(20 / 1)
    assert alone["rollout_fastest_trajectories_per_s"] == pytest.approx(4 / 1)


def test_masked_members_are_not_trainable_rollout_work():
    alone = rollout_alone(groups=_ready([1, 2, 3], masked=1), action_tokens=lambda t: t["tokens"], skip=1, measured=2)
    assert alone["rollout_tokens_per_s"] == pytest.approx(10 / 2) and alone["rollout_trajectories_per_s"] == 1


def test_the_bound_is_the_slower_stage():
    b = bound({"rollout_tokens_per_s": 5.0, "rollout_trajectories_per_s": 1.0},
              {"learner_tokens_per_s": 8.0, "learner_trajectories_per_s": 0.5})
    assert b["bound_tokens_per_s"] == 5.0 and b["bound_trajectories_per_s"] == 0.5


def _overlap(rollout_s: float, steps: list[tuple[int, float]]) -> dict:
    """An asynchronous run whose stages overlap perfectly: batch k is cut at k * rollout_s (rollouts
    never wait), and the learner trains batch k (steps[k-1]: its tokens, in two trajectories, and its
    seconds) as soon as it is cut and the previous step is done."""
    requested = [{"group_id": f"g{k}", "dispatched_at_ms": 0, "validation": False} for k in range(len(steps))]
    cut_batches, weights, metrics = [], [{"version": 0, "batch_id": None, "published_at_ms": 0}], []
    done = 0.0
    for k, (tokens, learner_s) in enumerate(steps, start=1):
        cut = k * rollout_s
        done = max(cut, done) + learner_s
        cut_batches.append({"batch_id": f"b{k}", "index": k, "group_ids": [f"g{k}"], "created_at_ms": int(cut * 1000),
                            "items": [{"trajectory": _traj(tokens // 2, [k - 1])} for _ in range(2)]})
        weights.append({"version": k, "batch_id": f"b{k}", "published_at_ms": int(done * 1000)})
        metrics.append(_metric(k, "timing/actor_s", learner_s, int(done * 1000)))
    return dict(requested=requested, steps=[], batches=cut_batches, weights=weights, metrics=metrics)


def _perfect_overlap(rollout_s: float, learner_s: float, batches: int, tokens: int) -> dict:
    """_overlap with every step alike: the stages overlap perfectly at their rates alone."""
    return _overlap(rollout_s, [(tokens, learner_s)] * batches)


def _count(t: dict) -> int:
    return t["tokens"]


def _learner_of(run: dict, warmup_steps: int) -> dict:
    return learner_alone(action_tokens=_count, warmup_steps=warmup_steps,
                         **{k: v for k, v in run.items() if k in ("batches", "weights", "metrics")})


def _fast_rollout() -> dict:
    """Rollouts far faster than any learner below (a batch of 60 tokens every 0.1 s)."""
    return rollout_alone(groups=_ready([k * 0.1 for k in range(1, 13)], tokens=60), action_tokens=_count, skip=2,
                         measured=8, per_batch=1)


@pytest.mark.parametrize("rollout_s,learner_s", [(2.0, 3.0), (3.0, 2.0), (2.5, 2.5), (0.4, 7.0), (7.0, 0.4)])
def test_a_perfect_overlap_of_the_measured_stages_reaches_the_bound_and_never_beats_it(rollout_s, learner_s):
    tokens = 60
    run = _perfect_overlap(rollout_s, learner_s, batches=12, tokens=tokens)

    async_ = mode_figures(action_tokens=_count, warmup_steps=2, **run)
    # the stages alone at the same rates: a learner timed step by step, rollouts cut every rollout_s
    learner = _learner_of(run, warmup_steps=2)
    rollout = rollout_alone(groups=_ready([k * rollout_s for k in range(1, 13)], tokens=tokens),
                            action_tokens=_count, skip=2, measured=8)
    result = comparison({"trained_tokens_per_s": 1.0}, async_, bound(rollout, learner))
    assert result["of_bound"] == pytest.approx(1.0, abs=1e-3)
    assert result["of_bound"] <= 1.0 + 1e-3 and result["of_bound_trajectories"] <= 1.0 + 1e-3


# the learner's steps alone, in the asynchronous layout: batches of unequal tokens and seconds
ALONE_STEPS = [(60, 3.0), (40, 2.5), (80, 3.5), (60, 2.8)]


@pytest.mark.parametrize("drawn", list(itertools.product(range(len(ALONE_STEPS)), repeat=3)))
def test_async_beats_the_bound_only_by_the_noise_of_the_stages_alone(drawn):
    # An asynchronous run, overlapping perfectly, whose every step is one measured alone (any of
    # them, any number of times): async / bound may exceed 1, since its steps can be the faster
    # ones, but never the noise limit, which its fastest steps alone reach.
    alone = bound(_fast_rollout(), _learner_of(_overlap(0.1, [(60, 3.0)] + ALONE_STEPS), warmup_steps=1))
    async_ = mode_figures(action_tokens=_count, warmup_steps=1,
                          **_overlap(0.1, [(60, 3.0)] + [ALONE_STEPS[i] for i in drawn]))
    result = comparison({"trained_tokens_per_s": 1.0}, async_, alone)
    fastest = max(t / s for t, s in ALONE_STEPS) / (sum(t for t, _ in ALONE_STEPS) / sum(s for _, s in ALONE_STEPS))
    assert result["of_bound_noise_limit"] == pytest.approx(fastest, rel=1e-3)
    assert result["of_bound"] <= result["of_bound_noise_limit"] + 1e-3
    assert result["of_bound_trajectories"] <= result["of_bound_trajectories_noise_limit"] + 1e-3
    assert not any("does not hold" in line for line in bound_warnings(result))
    if drawn == (2, 2, 2):  # the fastest step alone, three times over: the noise limit itself
        assert result["of_bound"] == pytest.approx(result["of_bound_noise_limit"], rel=1e-3)


def test_a_learner_alone_slower_than_the_asynchronous_steps_is_a_bound_that_does_not_hold():
    # the learner alone measured where each broadcast costs more (every engine current): its steps
    # take 1.8x the asynchronous mode's own for the same tokens, so async beats it beyond any noise
    async_steps = [(60, 3.0), (60, 3.2), (60, 3.1)]
    alone = bound(_fast_rollout(), _learner_of(_overlap(0.1, [(60, 5.0)] + [(t, 1.8 * s) for t, s in async_steps]),
                                               warmup_steps=1))
    async_ = mode_figures(action_tokens=_count, warmup_steps=1, **_overlap(0.1, [(60, 5.0)] + async_steps))
    result = comparison({"trained_tokens_per_s": 1.0}, async_, alone)
    assert result["of_bound"] == pytest.approx(1.8, rel=1e-3) and result["of_bound"] > result["of_bound_noise_limit"]
    [tokens, trajectories] = bound_warnings(result)
    assert "1.800 in tokens exceeds 1 beyond the noise" in tokens and "the bound does not hold" in tokens
    assert "in trajectories" in trajectories


def test_async_at_or_below_the_bound_has_no_warning_and_above_it_within_the_noise_one_line():
    assert bound_warnings({"of_bound": 1.0, "of_bound_noise_limit": 1.2,
                           "of_bound_trajectories": 0.7, "of_bound_trajectories_noise_limit": 1.1}) == []
    [line] = bound_warnings({"of_bound": 1.05, "of_bound_noise_limit": 1.2,
                             "of_bound_trajectories": 0.9, "of_bound_trajectories_noise_limit": 1.1})
    assert line.startswith("async / bound 1.050 in tokens exceeds 1, within the noise") and "1.200" in line


def test_the_learner_alone_replays_the_batches_the_asynchronous_learner_trained_in_version_order():
    batches = [{"batch_id": "b2"}, {"batch_id": "b1"}, {"batch_id": "b2"}, {"batch_id": "b3"}]
    weights = [{"version": 0, "batch_id": None}, {"version": 2, "batch_id": "b2"}, {"version": 1, "batch_id": "b1"}]
    # b3 was cut (the second batch in flight) but never trained: not replayed
    assert [b["batch_id"] for b in replay_order(batches, weights)] == ["b1", "b2"]
    with pytest.raises(ValueError, match="batch b3 is a claim check"):
        replay_order([{"batch_id": "b3", "payload_uri": "s3://rollstream-payloads/b3"}],
                     [{"version": 1, "batch_id": "b3"}])
    with pytest.raises(ValueError, match="version 1 was trained from batch b9"):
        replay_order(batches, [{"version": 1, "batch_id": "b9"}])


def test_every_measured_version_of_the_replay_must_train_the_asynchronous_mode_s_batch_of_that_version():
    def weights(batch_of: dict[int, str]) -> list[dict]:
        return [{"version": 0, "batch_id": None}, *({"version": v, "batch_id": b} for v, b in batch_of.items())]

    run = {1: "b1", 2: "b2", 3: "b3"}
    assert replay_differences(weights(run), weights(run), warmup_steps=1) == []
    assert replay_differences(weights({**run, 1: "bx"}), weights(run), warmup_steps=1) == []  # warm-up
    assert replay_differences(weights({**run, 3: "bx"}), weights(run), 1) == [
        "version 3: learner alone trained bx, the asynchronous mode b3"]
    assert replay_differences(weights({1: "b1", 2: "b2"}), weights(run), 1) == [
        "version 3 trained only in the asynchronous run"]


def test_the_modes_share_the_workload_and_engine_count_and_differ_in_their_pipeline_shape():
    base = load_config(REPO_ROOT / "configs" / "pipeline.yaml")
    sync, async_ = mode_config(base, "sync", 2, 1), mode_config(base, "async", 2, 1)
    assert sync.streams == async_.streams and sync.learner == async_.learner and sync.max_steps == async_.max_steps == 3
    assert sync.engines.current == async_.engines.current + async_.engines.stale and sync.engines.stale == 0
    assert sync.mix.max_in_flight_groups == base.streams.batch_size
    assert async_.mix.max_in_flight_groups == base.mix.max_in_flight_groups  # the workload's own bound
    assert mode_config(base, ALONE, 2, 1).engines == async_.engines


def test_a_run_that_trained_nothing_has_no_figures(run):
    with pytest.raises(ValueError, match="trained nothing"):
        mode_figures(action_tokens=len, **{**run, "weights": run["weights"][:1]})


def test_ratios():
    assert comparison({"trained_tokens_per_s": 2.0}, {"trained_tokens_per_s": 4.5, "trajectories_per_s": 1.5},
                      {"bound_tokens_per_s": 5.0, "bound_trajectories_per_s": 2.0,
                       "bound_fastest_tokens_per_s": 6.0, "bound_fastest_trajectories_per_s": 2.0}) == \
        {"ratio": 2.25, "of_bound": 0.9, "of_bound_trajectories": 0.75, "of_cores_bound": None,
         "of_bound_noise_limit": 1.2, "of_bound_trajectories_noise_limit": 1.0}


# the machine's CPU: samples of (wall ms, busy CPU seconds since boot); here two cores, busy 1.5 of them from 1 s on
SAMPLES = [(0, 100.0), (1000, 100.5), (2000, 102.0), (3000, 103.5)]


def test_cpu_between_interpolates_inside_the_samples_and_counts_overlapping_intervals_once():
    assert cpu_between(SAMPLES, [(1000, 3000)]) == pytest.approx(3.0)
    assert cpu_between(SAMPLES, [(1500, 2500)]) == pytest.approx(1.5)
    assert cpu_between(SAMPLES, [(0, 2000), (1000, 2000)]) == pytest.approx(2.0)


def test_cpu_outside_the_samples_is_unknown_not_zero():
    assert cpu_between(SAMPLES, [(2500, 3500)]) is None
    assert cpu_between([], [(0, 1000)]) is None
    assert stage_cpu(SAMPLES, [(2500, 3500)], tokens=10, cores=2) == {"cpu_busy": None, "cpu_s_per_token": None}


def test_a_stage_s_cpu_is_the_share_of_the_cores_busy_and_cpu_seconds_per_trained_token():
    figures = stage_cpu(SAMPLES, [(1000, 2000), (2000, 3000)], tokens=600, cores=2)
    assert figures["cpu_busy"] == pytest.approx(0.75) and figures["cpu_s_per_token"] == pytest.approx(0.005)


def test_the_cores_bound_is_what_the_cores_allow_when_both_stages_spend_their_own_cpu_per_token():
    # 4 ms of CPU per token to roll out, 1 ms to train: two cores can train at most 2 / 0.005 = 400 tokens/s
    assert cores_bound(0.004, 0.001, cores=2) == pytest.approx(400.0)
    assert cores_bound(None, 0.001, cores=2) is None


def test_async_is_measured_against_the_lower_of_the_stages_bound_and_the_cores_bound():
    alone = {"bound_tokens_per_s": 5.0, "bound_trajectories_per_s": 2.0, "cores_bound_tokens_per_s": 4.0}
    result = comparison({"trained_tokens_per_s": 2.0}, {"trained_tokens_per_s": 3.0, "trajectories_per_s": 1.0}, alone)
    assert result["of_bound"] == pytest.approx(0.6) and result["of_cores_bound"] == pytest.approx(0.75)
    alone["cores_bound_tokens_per_s"] = 10.0
    result = comparison({"trained_tokens_per_s": 2.0}, {"trained_tokens_per_s": 3.0, "trajectories_per_s": 1.0}, alone)
    assert result["of_cores_bound"] == pytest.approx(0.6)
