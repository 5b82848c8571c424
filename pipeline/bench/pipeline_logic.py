"""`rollstream bench pipeline`, the pure part: the figures of one mode's run, from its replayed events,
and the bound perfect overlap of the stages would reach.

Warm windows. Every run starts fresh engines, whose first requests pay compilation and cold caches,
and the learner's first step pays its own warm-up. So each mode trains `warmup_steps` steps first,
not measured, and its window runs from the publication of the last warm-up version to the last
version; its figures count the batches trained into the versions after the warm-up:

- wall: the window;
- trained tokens/s: action tokens of those batches' items / wall; trajectories/s likewise;
- engine busy: per engine, the union of its generation intervals (steps: started_at_ms +
  generate_ms) within the window over the wall, averaged over the engines;
- learner busy: the measured steps' intervals (its metrics: ref + actor + publish seconds, ending
  at the metric's time) over the wall;
- staleness: per trained turn, (version trained into - 1) - the turn's weight version.

The bound. Asynchrony can at best overlap the two stages perfectly; the pipeline then runs at the
slower stage's rate, so bound = min(rollout rate alone, learner rate alone), each measured alone
and warm, and each in the asynchronous mode's own conditions, so that nothing but the overlap
separates them from it:

- learner alone: the asynchronous mode's own batches, replayed after it by a learner process of its
  own from the same initial policy, back to back with no engine running: the same tokens, the same
  items, the same warm-up steps left out. Its measured steps' trained tokens (trajectories) / their
  busy seconds. Not a run of its own with one batch in flight (until 2026-12-03): its batches held
  about 190 tokens a step against the asynchronous mode's 720, and a step's time does not grow in
  proportion, so a rate taken on short batches did not bound one on long batches (async / bound
  16.2). Not the synchronous run's steps: there every engine is current and each version is
  broadcast to both (1.8x slower steps for the same tokens, 2026-12-02). Not the rollout run's
  learner with its dispatcher held: the batcher takes every ready group into the batch after the
  hold, so that learner trains one batch of all of them and then waits for ever
  (tests/unit/test_batcher_held.py). The replay broadcasts nothing (0.2-0.7 s a step here), which
  can only raise the bound;
- rollout alone: a run of its own on fresh engines with the learner held idle, every group it will
  need let out at once (so as many rollouts run at a time as the env workers take, at least what
  the asynchronous mode keeps in flight). Groups become ready (all members in) in some order; the
  first `skip` are the warm-up (the rollouts begun on cold engines end there), and the rate is the
  trainable tokens (trajectories) of the next `measured` groups over the time from group `skip`
  being ready to the last of them, while the groups still queued keep every rollout slot busy.
  Groups, not batches: the batcher cuts no further than the learner can take.

Measured over the same warm windows, a perfect overlap of these stage rates publishes a version
every max(rollout, learner) seconds per batch, which is the bound: async / bound is at most 1 for
it (a unit test builds that schedule), and a real asynchronous run, whose stages contend for the
same machine, stays below. Except by noise: a rate alone is a mean over a few steps (groups), and
the asynchronous run may draw faster ones. Each stage also reports its fastest step (its fastest
batch_size groups), and async / bound can exceed 1 by no more than min(fastest rollout, fastest
learner) / bound (`noise_limit`) unless an asynchronous step beat every step measured alone, i.e.
the stages alone were not measured in the asynchronous mode's conditions: the bound does not hold.
The benchmark says which of the two it is whenever async / bound exceeds 1 (`bound_warnings`); it
never clamps the figure.

The cores. That bound takes each stage's rate on the whole machine; where both stages share one
machine's cores (here), overlapping them gains nothing once the cores are full. So the machine's busy
CPU seconds are sampled through every run, and each window (a mode's, a stage's measured steps alone)
gets the share of the cores busy and CPU seconds per trained token (`stage_cpu`). The cores' estimate
is cores / (rollout's + learner's CPU seconds per token alone): the rate at which both stages'
CPU, as each spent it alone, fits in the cores (`cores_bound`). An estimate, not a bound by
construction: a stage's CPU per token can change beside the other.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Interval = tuple[int, int]  # [start_ms, end_ms)

LEARNER_BUSY = ("timing/ref_s", "timing/actor_s", "timing/publish_s")


def union_ms(intervals: Iterable[Interval]) -> int:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals with overlaps merged, in order (what a timeline draws)."""
    out: list[list[int]] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def engine_intervals(steps: Iterable[Mapping[str, Any]]) -> dict[str, list[Interval]]:
    """engine id -> its generation intervals."""
    by_engine: dict[str, list[Interval]] = defaultdict(list)
    for s in steps:
        start = int(s["started_at_ms"])
        by_engine[s["engine_id"]].append((start, start + int(round(s["generate_ms"]))))
    return dict(by_engine)


def learner_intervals(metrics: Iterable[Mapping[str, Any]]) -> dict[int, Interval]:
    """learner step -> its busy interval (ref + actor + publish, ending when its metrics were sent)."""
    busy: dict[int, float] = defaultdict(float)
    end: dict[int, int] = {}
    for m in metrics:
        if m["source"] == "learner" and m["name"] in LEARNER_BUSY:
            busy[m["step"]] += m["value"]
            end[m["step"]] = max(end.get(m["step"], 0), int(m["at_ms"]))
    return {step: (end[step] - int(round(busy[step] * 1000)), end[step]) for step in sorted(end)}


def window_start_ms(requested: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]],
                    warmup_steps: int) -> int:
    """Where a mode's measured window begins: the publication of the last warm-up version (the first
    dispatched task without a warm-up)."""
    if warmup_steps == 0:
        return min(r["dispatched_at_ms"] for r in requested)
    warm = [w for w in weights if w.get("batch_id") is not None and w["version"] == warmup_steps]
    if not warm:
        raise ValueError(f"the run did not finish its {warmup_steps} warm-up steps: no figures")
    return min(int(w["published_at_ms"]) for w in warm)


def _clipped(intervals: Iterable[Interval], start: int, end: int) -> list[Interval]:
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def mode_figures(*, requested: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
                 batches: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]],
                 metrics: Sequence[Mapping[str, Any]], action_tokens: Any, warmup_steps: int = 0) -> dict[str, Any]:
    """The figures of one mode over its warm window. `action_tokens(trajectory)` counts a trajectory's
    trained tokens."""
    trained = [w for w in weights if w.get("batch_id") is not None and w["version"] > warmup_steps]
    if not requested or not trained:
        raise ValueError("the run trained nothing after its warm-up: no figures")
    start = window_start_ms(requested, weights, warmup_steps)
    end = int(max(trained, key=lambda w: w["version"])["published_at_ms"])
    wall_ms = end - start
    trained_ids = {w["batch_id"]: w["version"] for w in trained}
    batch_of = {b["batch_id"]: b for b in batches}
    tokens = trajectories = 0
    staleness: list[int] = []
    for batch_id, version in trained_ids.items():
        batch = batch_of.get(batch_id)
        if batch is None:
            continue
        for item in batch["items"]:
            t = item["trajectory"]
            tokens += action_tokens(t)
            trajectories += 1
            staleness += [version - 1 - u["weight_version"] for u in t["turns"]]
    engines = {e: _clipped(iv, start, end) for e, iv in engine_intervals(steps).items()}
    learner = {k: iv for k, iv in learner_intervals(metrics).items() if k > warmup_steps}
    return {
        "wall_s": wall_ms / 1000, "learner_steps": len(trained_ids), "warmup_steps": warmup_steps,
        "trained_tokens": tokens, "trained_tokens_per_s": tokens * 1000 / wall_ms,
        "trajectories_per_s": trajectories * 1000 / wall_ms,
        "engine_busy": (sum(union_ms(i) for i in engines.values()) / (len(engines) * wall_ms)) if engines else 0.0,
        "learner_busy": sum(b - a for a, b in _clipped(learner.values(), start, end)) / wall_ms,
        "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
        "start_ms": start, "end_ms": end,
    }


def _step_work(batches: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]],
               metrics: Sequence[Mapping[str, Any]], action_tokens: Any, warmup_steps: int) -> list[tuple[int, int, int]]:
    """(trained tokens, trajectories, busy ms) of each measured learner step with a known batch."""
    batch_of = {b["batch_id"]: b for b in batches}
    steps = learner_intervals(metrics)
    work = []
    for w in sorted(weights, key=lambda w: w["version"]):
        batch, step = batch_of.get(w.get("batch_id")), steps.get(w["version"])
        if w["version"] <= warmup_steps or batch is None or step is None or step[1] <= step[0]:
            continue
        work.append((sum(action_tokens(i["trajectory"]) for i in batch["items"]), len(batch["items"]), step[1] - step[0]))
    return work


def learner_alone(*, batches: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]],
                  metrics: Sequence[Mapping[str, Any]], action_tokens: Any, warmup_steps: int) -> dict[str, Any]:
    """The learner's rate in a run's steps after its warm-up (alone when nothing else ran while it
    trained): their trained tokens and trajectories over their busy seconds, and its fastest step's."""
    work = _step_work(batches, weights, metrics, action_tokens, warmup_steps)
    busy_ms = sum(ms for _, _, ms in work)
    if not busy_ms:
        raise ValueError("no measured learner step: no learner rate")
    tokens = sum(t for t, _, _ in work)
    return {"learner_tokens": tokens, "learner_tokens_per_s": tokens * 1000 / busy_ms,
            "learner_trajectories_per_s": sum(n for _, n, _ in work) * 1000 / busy_ms,
            "learner_fastest_tokens_per_s": max(t * 1000 / ms for t, _, ms in work),
            "learner_fastest_trajectories_per_s": max(n * 1000 / ms for _, n, ms in work),
            "learner_steps": len(work)}


def rollout_alone(*, groups: Sequence[Mapping[str, Any]], action_tokens: Any, skip: int,
                  measured: int, per_batch: int | None = None) -> dict[str, Any]:
    """The rollout rate alone, from a run whose learner stayed idle: the trainable tokens and
    trajectories (unmasked members) of training groups skip+1 .. skip+measured, in the order they
    became ready, over the time from group `skip` being ready to the last of them; and the fastest
    rate of `per_batch` consecutive of those groups (a batch's worth; default: all of them)."""
    first: dict[str, Mapping[str, Any]] = {}
    for g in groups:
        if not g["validation"]:
            first.setdefault(g["group_id"], g)  # a group event read twice counts once
    ready = sorted(first.values(), key=lambda g: (g["ready_at_ms"], g["group_id"]))
    if skip < 1 or measured < 1 or len(ready) < skip + measured:
        raise ValueError(f"{len(ready)} groups ready, {skip} + {measured} needed: no rollout rate")
    window = ready[skip:skip + measured]
    span_ms = window[-1]["ready_at_ms"] - ready[skip - 1]["ready_at_ms"]
    if span_ms <= 0:
        raise ValueError("the measured groups were ready at the same time as the warm-up's: no rollout rate")

    def work(chunk: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        members = [m["trajectory"] for g in chunk for m in g["members"] if not m["masked"]]
        return sum(action_tokens(t) for t in members), len(members)

    tokens, trajectories = work(window)
    # non-overlapping runs of a batch's worth of groups, each from the group ready before it; a run
    # whose groups were all ready at once has no rate of its own and is left out
    size = per_batch or measured
    chunks = []
    for i in range(skip, skip + measured - size + 1, size):
        chunk_ms = ready[i + size - 1]["ready_at_ms"] - ready[i - 1]["ready_at_ms"]
        if chunk_ms > 0:
            chunks.append((*work(ready[i:i + size]), chunk_ms))
    chunks = chunks or [(tokens, trajectories, span_ms)]
    return {"rollout_tokens": tokens, "rollout_tokens_per_s": tokens * 1000 / span_ms,
            "rollout_trajectories_per_s": trajectories * 1000 / span_ms,
            "rollout_fastest_tokens_per_s": max(t * 1000 / ms for t, _, ms in chunks),
            "rollout_fastest_trajectories_per_s": max(n * 1000 / ms for _, n, ms in chunks),
            "rollout_groups": measured, "rollout_window_s": span_ms / 1000,
            "rollout_window_ms": (ready[skip - 1]["ready_at_ms"], window[-1]["ready_at_ms"])}


def bound(rollout: Mapping[str, Any], learner: Mapping[str, Any]) -> dict[str, Any]:
    """Both stages' rates alone and the rate their perfect overlap would reach: the slower one; and
    the most a perfect overlap of their fastest steps could reach (what noise can lift a run to)."""
    out = {**rollout, **learner}
    for unit in ("tokens", "trajectories"):
        out[f"bound_{unit}_per_s"] = min(rollout[f"rollout_{unit}_per_s"], learner[f"learner_{unit}_per_s"])
        # a stage without its fastest step: its rate stands for it
        out[f"bound_fastest_{unit}_per_s"] = min(stage.get(f"{name}_fastest_{unit}_per_s", stage[f"{name}_{unit}_per_s"])
                                                  for name, stage in (("rollout", rollout), ("learner", learner)))
    return out


def comparison(sync: Mapping[str, Any], async_: Mapping[str, Any], alone: Mapping[str, float]) -> dict[str, Any]:
    """async/sync and async/bound in trained tokens/s (and async/bound in trajectories/s), each
    async/bound with its noise limit: the highest it can reach while the bound holds; and async against the
    lower of the bound and the cores' estimate (cores_bound) where the stages' CPU was sampled."""
    ratio = async_["trained_tokens_per_s"] / sync["trained_tokens_per_s"] if sync["trained_tokens_per_s"] else None
    out: dict[str, Any] = {"ratio": ratio}
    by_cores = alone.get("cores_bound_tokens_per_s")
    both = min(by_cores, alone["bound_tokens_per_s"]) if by_cores and alone.get("bound_tokens_per_s") else None
    out["of_cores_bound"] = async_["trained_tokens_per_s"] / both if both else None
    for key, unit, rate in (("of_bound", "tokens", "trained_tokens_per_s"),
                            ("of_bound_trajectories", "trajectories", "trajectories_per_s")):
        by = alone.get(f"bound_{unit}_per_s")
        out[key] = async_[rate] / by if by else None
        out[f"{key}_noise_limit"] = alone.get(f"bound_fastest_{unit}_per_s", by) / by if by else None
    return out


def bound_warnings(result: Mapping[str, Any]) -> list[str]:
    """One line per async/bound above 1 (never clamped): within the noise limit, or beyond it, which
    means an asynchronous step beat every step measured alone, and the bound does not hold."""
    lines = []
    for key, unit in (("of_bound", "tokens"), ("of_bound_trajectories", "trajectories")):
        of_bound, limit = result.get(key), result.get(f"{key}_noise_limit")
        if of_bound is None or of_bound <= 1.0:
            continue
        if limit is not None and of_bound <= limit:
            lines.append(f"async / bound {of_bound:.3f} in {unit} exceeds 1, within the noise of the stages alone "
                         f"(their fastest steps allow up to {limit:.3f})")
        else:
            lines.append(f"async / bound {of_bound:.3f} in {unit} exceeds 1 beyond the noise of the stages alone "
                         f"(at most {limit or 1.0:.3f}): the bound does not hold, the stages alone were not "
                         f"measured in the asynchronous mode's conditions")
    return lines


CpuSamples = Sequence[tuple[int, float]]  # (wall time ms, the machine's busy CPU seconds since boot), in order


def _busy_at(samples: CpuSamples, at_ms: int) -> float:
    i = bisect.bisect_left(samples, at_ms, key=lambda s: s[0])
    if samples[i][0] == at_ms:
        return samples[i][1]
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * (at_ms - t0) / (t1 - t0)


def cpu_between(samples: CpuSamples, intervals: Iterable[Interval]) -> float | None:
    """The machine's busy CPU seconds within the intervals (overlaps counted once), interpolated linearly
    between the samples around each end; None when the samples do not cover them all."""
    spans = merged(intervals)
    if not spans or not samples or spans[0][0] < samples[0][0] or spans[-1][1] > samples[-1][0]:
        return None
    return sum(_busy_at(samples, b) - _busy_at(samples, a) for a, b in spans)


def stage_cpu(samples: CpuSamples, intervals: Iterable[Interval], tokens: int, cores: int) -> dict[str, float | None]:
    """What the machine's cores did while a stage (or a mode) worked: the busy share of all its cores over
    the intervals, and busy CPU seconds per trained token."""
    spans = merged(intervals)
    cpu_s = cpu_between(samples, spans)
    wall_s = sum(b - a for a, b in spans) / 1000
    return {"cpu_busy": cpu_s / (cores * wall_s) if cpu_s is not None and wall_s > 0 else None,
            "cpu_s_per_token": cpu_s / tokens if cpu_s is not None and tokens else None}


def cores_bound(rollout_cpu_s_per_token: float | None, learner_cpu_s_per_token: float | None,
                cores: int) -> float | None:
    """Trained tokens/s the machine's cores allow when the two stages share them, each spending per token the
    CPU it spent alone: cores / (rollout's + learner's CPU seconds per token). Where the stages run on
    hardware of their own (the paper's) this does not apply; on one machine's cores it can lie below the
    bound of the stages alone. An estimate, not a strict bound: a stage's CPU per token can change beside
    the other (a niced engine's idle threads spin less when the learner takes their core)."""
    if not rollout_cpu_s_per_token or not learner_cpu_s_per_token:
        return None
    return cores / (rollout_cpu_s_per_token + learner_cpu_s_per_token)


Events = Mapping[str, Sequence[Mapping[str, Any]]]


def replay_order(batches: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The batches a run's learner trained, each once, in the order of the versions they made: what the
    learner-alone run replays (a batch cut but never trained, the second of two in flight at the end,
    is left out). A batch stored in the object store (a claim check) is refused, since its stored copy
    names the run it was cut for."""
    by_id = {b["batch_id"]: b for b in batches}
    trained = sorted((w for w in weights if w.get("batch_id") is not None), key=lambda w: w["version"])
    out: dict[str, Mapping[str, Any]] = {}
    for w in trained:
        batch = by_id.get(w["batch_id"])
        if batch is None:
            raise ValueError(f"version {w['version']} was trained from batch {w['batch_id']}, which the run's "
                             "`batches` do not hold")
        if batch.get("payload_uri"):
            raise ValueError(f"batch {batch['batch_id']} is a claim check (stored in the object store): the "
                             "learner-alone run replays batches as events; use smaller batches")
        out.setdefault(batch["batch_id"], batch)
    return list(out.values())


def replay_differences(alone_weights: Sequence[Mapping[str, Any]], async_weights: Sequence[Mapping[str, Any]],
                       warmup_steps: int) -> list[str]:
    """Where the learner-alone run's measured versions did not train the asynchronous mode's batch of
    the same version. Empty when every measured version matches."""
    def trained(weights: Sequence[Mapping[str, Any]]) -> dict[int, str]:
        return {int(w["version"]): w["batch_id"] for w in weights
                if w.get("batch_id") is not None and w["version"] > warmup_steps}

    ours, theirs = trained(alone_weights), trained(async_weights)
    out = []
    for version in sorted(ours.keys() | theirs.keys()):
        if version not in ours or version not in theirs:
            out.append(f"version {version} trained only in the {'learner-alone' if version in ours else 'asynchronous'} run")
        elif ours[version] != theirs[version]:
            out.append(f"version {version}: learner alone trained {ours[version]}, the asynchronous mode {theirs[version]}")
    return out
