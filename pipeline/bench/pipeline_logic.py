"""`rollstream bench pipeline`, the pure part: the figures of one mode's run, from its replayed events.

- wall: from the first dispatched task to the last version the learner published;
- trained tokens/s: action tokens of every trained batch item / wall; trajectories/s likewise;
- engine busy: per engine, the union of its generation intervals (steps: started_at_ms +
  generate_ms) over the wall, averaged over the engines;
- learner busy: the learner's step intervals (its metrics: ref + actor + publish seconds, ending at
  the metric's time) over the wall;
- staleness: per trained turn, (version trained into - 1) - the turn's weight version;
- stages alone: in the synchronous mode the phases do not overlap, so each is measured alone there:
  rollout = a batch's action tokens / (its batch cut - its first dispatch), learner = its action
  tokens / its step's busy seconds. Perfect overlap would run at the slower stage's rate: the bound.
"""

from __future__ import annotations

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


def mode_figures(*, requested: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
                 batches: Sequence[Mapping[str, Any]], weights: Sequence[Mapping[str, Any]],
                 metrics: Sequence[Mapping[str, Any]], action_tokens: Any) -> dict[str, Any]:
    """The figures of one mode. `action_tokens(trajectory)` counts a trajectory's trained tokens."""
    trained = [w for w in weights if w.get("batch_id") is not None]
    if not requested or not trained:
        raise ValueError("the run trained nothing: no figures")
    start = min(r["dispatched_at_ms"] for r in requested)
    last = max(trained, key=lambda w: w["version"])
    end = int(last["published_at_ms"])
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
    engines = engine_intervals(s for s in steps if start <= s["started_at_ms"] <= end)
    learner = learner_intervals(metrics)
    return {
        "wall_s": wall_ms / 1000, "learner_steps": len(trained_ids), "trained_tokens": tokens,
        "trained_tokens_per_s": tokens * 1000 / wall_ms, "trajectories_per_s": trajectories * 1000 / wall_ms,
        "engine_busy": (sum(union_ms(i) for i in engines.values()) / (len(engines) * wall_ms)) if engines else 0.0,
        "learner_busy": sum(b - a for a, b in learner.values()) / wall_ms,
        "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
        "start_ms": start, "end_ms": end,
    }


def stages_alone(*, requested: Sequence[Mapping[str, Any]], batches: Sequence[Mapping[str, Any]],
                 weights: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]],
                 action_tokens: Any) -> dict[str, float]:
    """Trained tokens/s of each stage alone, from a synchronous run (its phases never overlap)."""
    dispatched = defaultdict(lambda: float("inf"))
    for r in requested:
        dispatched[r["group_id"]] = min(dispatched[r["group_id"]], r["dispatched_at_ms"])
    step_of = {w["batch_id"]: w["version"] for w in weights if w.get("batch_id") is not None}
    learner = learner_intervals(metrics)
    rollout_tokens = rollout_ms = learner_tokens = learner_ms = 0.0
    for b in batches:
        if b["batch_id"] not in step_of:
            continue
        tokens = sum(action_tokens(i["trajectory"]) for i in b["items"])
        first = min(dispatched[g] for g in b["group_ids"])
        if first != float("inf") and b["created_at_ms"] > first:
            rollout_tokens += tokens
            rollout_ms += b["created_at_ms"] - first
        step = learner.get(step_of[b["batch_id"]])
        if step is not None and step[1] > step[0]:
            learner_tokens += tokens
            learner_ms += step[1] - step[0]
    rollout = rollout_tokens * 1000 / rollout_ms if rollout_ms else 0.0
    train = learner_tokens * 1000 / learner_ms if learner_ms else 0.0
    return {"rollout_tokens_per_s": rollout, "learner_tokens_per_s": train, "bound_tokens_per_s": min(rollout, train)}


def comparison(sync: Mapping[str, Any], async_: Mapping[str, Any], alone: Mapping[str, float]) -> dict[str, Any]:
    """async/sync and async/bound in trained tokens/s."""
    ratio = async_["trained_tokens_per_s"] / sync["trained_tokens_per_s"] if sync["trained_tokens_per_s"] else None
    bound = alone["bound_tokens_per_s"]
    return {"ratio": ratio, "of_bound": async_["trained_tokens_per_s"] / bound if bound else None}
