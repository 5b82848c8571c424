"""The run report: one folder per run with report.md, summary.json and PNG figures, rebuilt from
the run's events alone (issue #7 "The report").

`build_report` takes decoded events per topic (plain dicts as schemas/avro/*.avsc define them,
optionally with `_timestamp_ms`, the Kafka record time), so it runs on a live run, a finished one,
or synthetic events. The series behind each figure are plain functions of those events; a
section whose data is missing says so instead of failing.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from pydantic import BaseModel, ConfigDict, Field

from pipeline.analysis import evaluation
from schemas import codec, topics
from streams import behaviour
from streams.alerts import RunHold

Event = Mapping[str, Any]
Events = Mapping[str, Sequence[Event]]

# Learner metric names (learner/loss.py, learner/step.py) per panel of the learner figure.
LOSS_METRICS = ("actor/loss", "actor/pg_loss")
KL_METRICS = ("actor/kl_loss", "actor/ppo_kl")
CLIP_METRICS = ("actor/pg_clipfrac",)

# Wall-clock fields of each event type: the run's span is the earliest to the latest of them.
_TIME_FIELDS = {
    topics.TRAJECTORIES: ("started_at_ms", "finished_at_ms"), topics.STEPS: ("started_at_ms",),
    topics.GROUPS: ("ready_at_ms",), topics.BATCHES: ("created_at_ms",), topics.WEIGHTS: ("published_at_ms",),
    topics.METRICS: ("at_ms",), topics.TASKS_REQUESTED: ("dispatched_at_ms",), topics.ALERTS: ("at_ms",),
}
# What makes two events of one topic the same event (delivery is at-least-once).
_IDENTITY: dict[str, Callable[[Event], Any]] = {
    topics.TRAJECTORIES: lambda e: e["trajectory_id"], topics.STEPS: lambda e: (e["trajectory_id"], e["turn"]),
    topics.GROUPS: lambda e: e["group_id"], topics.BATCHES: lambda e: e["batch_id"],
    topics.WEIGHTS: lambda e: e["version"], topics.TASKS_REQUESTED: lambda e: (e["group_id"], e["member"]),
    topics.ALERTS: lambda e: e["alert_id"],
}


class ReportSettings(BaseModel):
    """How the report draws its figures (not in the AgentRL paper)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dpi: int = Field(120, ge=50)
    """Resolution of the PNG figures."""
    version_buckets: int = Field(20, ge=1)
    """At most this many points on a learner-version axis (versions are grouped into equal buckets)."""
    time_bucket_s: float = Field(60.0, gt=0)
    """Width of a time bucket for throughput and stale-turn share (per minute)."""


# ---------------------------------------------------------------- events -> series (pure)

def run_events(events: Events, run: str) -> dict[str, list[Event]]:
    """The run's events per topic, each event once (first occurrence)."""
    out: dict[str, list[Event]] = {}
    for topic, evs in events.items():
        identity, seen, kept = _IDENTITY.get(topic), set(), []
        for e in evs:
            if e.get("run") != run:
                continue
            if identity is not None:
                key = identity(e)
                if key in seen:
                    continue
                seen.add(key)
            kept.append(e)
        out[topic] = kept
    return out


def run_span_ms(events: Events) -> tuple[int, int] | None:
    """Earliest and latest time of the run's events: their Kafka record timestamps when known (the
    producer's clock, always real), else the wall-clock fields inside the events (a benchmark or a
    test may fill some of those with a fixed time)."""
    stamps = [e["_timestamp_ms"] for evs in events.values() for e in evs if e.get("_timestamp_ms") is not None]
    times = stamps or [e[f] for topic, evs in events.items() for e in evs
                       for f in _TIME_FIELDS.get(topic, ()) if e.get(f) is not None]
    return (min(times), max(times)) if times else None


def learner_steps(weights: Iterable[Event]) -> int:
    """Learner steps taken: the newest weight version (version 0 is the initial weights, +1 per step)."""
    return max((int(w["version"]) for w in weights), default=0)


def trajectory_versions(trajs: Iterable[Event], steps: Iterable[Event], groups: Iterable[Event]) -> dict[str, int]:
    """trajectory_id -> the newest weight version that generated any of its turns: from its `steps`,
    else its own per-turn record, else its group's min_weight_version."""
    from_steps: dict[str, int] = {}
    for s in steps:
        from_steps[s["trajectory_id"]] = max(from_steps.get(s["trajectory_id"], -1), int(s["weight_version"]))
    group_min = {g["group_id"]: int(g["min_weight_version"]) for g in groups}
    out = {}
    for t in trajs:
        tid = t["trajectory_id"]
        if tid in from_steps:
            out[tid] = from_steps[tid]
        elif t.get("turns"):
            out[tid] = max(int(turn["weight_version"]) for turn in t["turns"])
        elif t["group_id"] in group_min:
            out[tid] = group_min[t["group_id"]]
    return out


def version_bucket_width(max_version: int, buckets: int) -> int:
    """Versions per bucket so that 0..max_version fits in at most `buckets` buckets."""
    return max(1, math.ceil((max_version + 1) / buckets))


def success_over_versions(train_trajs: Sequence[Event], versions: Mapping[str, int], buckets: int
                          ) -> tuple[int, dict[str, dict[str, list[float]]]]:
    """(bucket width, {task: {"version": bucket starts, "success", "reward", "episodes"}}) over the
    training trajectories whose version is known."""
    known = [t for t in train_trajs if t["trajectory_id"] in versions]
    if not known:
        return 1, {}
    width = version_bucket_width(max(versions[t["trajectory_id"]] for t in known), buckets)
    cells: dict[str, dict[int, list[Event]]] = {}
    for t in known:
        cells.setdefault(t["task"], {}).setdefault(versions[t["trajectory_id"]] // width * width, []).append(t)
    series = {}
    for task in sorted(cells):
        xs = sorted(cells[task])
        series[task] = {"version": xs,
                        "success": [statistics.fmean(evaluation.is_success(t) for t in cells[task][x]) for x in xs],
                        "reward": [statistics.fmean(t["reward"] for t in cells[task][x]) for x in xs],
                        "episodes": [len(cells[task][x]) for x in xs]}
    return width, series


def group_staleness(batches: Iterable[Event], weights: Iterable[Event], groups: Iterable[Event]) -> list[int]:
    """Per trained group: the learner version it was trained from minus its min_weight_version.
    A batch that became version V was trained from V - 1, so a group rolled out entirely with the
    weights being trained has staleness 0 (the learner's rollout/behaviour_lag, per group)."""
    became = {w["batch_id"]: int(w["version"]) for w in weights if w.get("batch_id")}
    group_min = {g["group_id"]: int(g["min_weight_version"]) for g in groups}
    out, counted = [], set()
    for b in batches:
        if b["batch_id"] not in became:
            continue  # not trained (yet, or skipped by the learner)
        turns_min: dict[str, int] = {}
        for item in b["items"]:
            t = item["trajectory"]
            for turn in t["turns"]:
                v = int(turn["weight_version"])
                turns_min[t["group_id"]] = min(turns_min.get(t["group_id"], v), v)
        for gid in b["group_ids"]:
            oldest = group_min.get(gid, turns_min.get(gid))
            if oldest is not None and gid not in counted:
                counted.add(gid)
                out.append(became[b["batch_id"]] - 1 - int(oldest))
    return out


def _bucket(ms: int, t0_ms: int, bucket_s: float) -> int:
    # An event's own time can precede the run's first record time by the produce latency: first bucket.
    return max(0, int((ms - t0_ms) / 1000.0 // bucket_s))


def training_turns(steps: Sequence[Event], train_trajs: Iterable[Event],
                   validation_groups: set[str]) -> tuple[str, list[tuple[int, str]]]:
    """(source, [(time ms, pool)]) of every training turn (validation is current-pool only, so left
    out): from `steps` at their start, or, when the run has no steps events, from the trajectories'
    own turn records at the trajectory's finish."""
    if steps:
        return "steps", [(s["started_at_ms"], s["pool"]) for s in steps if s["group_id"] not in validation_groups]
    return "trajectories", [(t["finished_at_ms"], turn["pool"]) for t in train_trajs for turn in t["turns"]]


def stale_share_over_time(turns: Iterable[tuple[int, str]], t0_ms: int, bucket_s: float) -> dict[str, list[float]]:
    """Per time bucket, the share of turns generated by the stale pool.
    {"minute": bucket starts in minutes, "share", "turns"}."""
    cells: dict[int, list[bool]] = {}
    for at_ms, pool in turns:
        cells.setdefault(_bucket(at_ms, t0_ms, bucket_s), []).append(pool == "stale")
    xs = sorted(cells)
    return {"minute": [x * bucket_s / 60.0 for x in xs], "share": [statistics.fmean(cells[x]) for x in xs],
            "turns": [len(cells[x]) for x in xs]}


def throughput_over_time(trajs: Iterable[Event], t0_ms: int, bucket_s: float) -> dict[str, list[float]]:
    """Per time bucket of finished trajectories: trajectories/s and tokens/s (num_tokens).
    {"minute", "trajectories_per_s", "tokens_per_s"}; empty buckets inside the span count as 0."""
    counts: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for t in trajs:
        b = _bucket(t["finished_at_ms"], t0_ms, bucket_s)
        counts[b] = counts.get(b, 0) + 1
        tokens[b] = tokens.get(b, 0) + int(t["num_tokens"])
    xs = list(range(min(counts), max(counts) + 1)) if counts else []
    return {"minute": [x * bucket_s / 60.0 for x in xs],
            "trajectories_per_s": [counts.get(x, 0) / bucket_s for x in xs],
            "tokens_per_s": [tokens.get(x, 0) / bucket_s for x in xs]}


def learner_series(metrics: Iterable[Event], names: Iterable[str]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) of the metrics events with `step` set; the last value of a step wins."""
    wanted = set(names)
    cells: dict[str, dict[int, float]] = {}
    for m in metrics:
        if m["name"] in wanted and m.get("step") is not None:
            cells.setdefault(m["name"], {})[int(m["step"])] = float(m["value"])
    return {name: (sorted(c), [c[s] for s in sorted(c)]) for name, c in sorted(cells.items())}


# ---------------------------------------------------------------- figures

def _integers(axis: Any) -> None:
    """Versions, steps and group counts are whole numbers: no 0.5 ticks."""
    axis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Figure, path: Path, dpi: int) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi)


def plot_success_over_versions(width: int, series: Mapping[str, Mapping[str, list[float]]], path: Path,
                               dpi: int) -> None:
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax_s, ax_r = fig.subplots(1, 2)
    for task, s in series.items():
        ax_s.plot(s["version"], [100 * v for v in s["success"]], marker="o", label=task)
        ax_r.plot(s["version"], s["reward"], marker="o", label=task)
    unit = "learner version" if width == 1 else f"learner version (buckets of {width})"
    ax_s.set(title="Training success rate", xlabel=unit, ylabel="success rate (%)", ylim=(-3, 103))
    ax_r.set(title="Training reward", xlabel=unit, ylabel="mean reward (after incomplete punishment)")
    for ax in (ax_s, ax_r):
        _integers(ax.xaxis)
        ax.grid(alpha=0.3)
        ax.legend(title="task")
    fig.suptitle("Per-task training trajectories by the newest weight version that generated them")
    _save(fig, path, dpi)


def plot_staleness(staleness: Sequence[int], path: Path, dpi: int) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    lo, hi = min(staleness), max(staleness)
    ax.hist(staleness, bins=[b - 0.5 for b in range(lo, hi + 2)], color="tab:blue", edgecolor="black",
            label=f"{len(staleness)} trained groups")
    ax.set(title="Staleness of trained groups",
           xlabel="learner version trained from − group's oldest weight version (versions)", ylabel="groups")
    _integers(ax.xaxis)
    _integers(ax.yaxis)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    _save(fig, path, dpi)


def plot_stale_share(series: Mapping[str, list[float]], bucket_s: float, path: Path, dpi: int) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(series["minute"], [100 * v for v in series["share"]], marker="o", label="turns from the stale pool")
    ax.set(title="Stale-turn share (training turns)", xlabel=f"minutes since run start ({bucket_s:g} s buckets)",
           ylabel="share of turns (%)", ylim=(-3, 103))
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path, dpi)


def plot_throughput(series: Mapping[str, list[float]], bucket_s: float, path: Path, dpi: int) -> None:
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax_t, ax_k = fig.subplots(2, 1, sharex=True)
    ax_t.plot(series["minute"], series["trajectories_per_s"], marker="o", color="tab:green", label="trajectories/s")
    ax_k.plot(series["minute"], series["tokens_per_s"], marker="o", color="tab:purple", label="tokens/s")
    ax_t.set(title="Rollout throughput (finished trajectories)", ylabel="trajectories / s")
    ax_k.set(xlabel=f"minutes since run start ({bucket_s:g} s buckets)", ylabel="tokens / s (whole sequences)")
    for ax in (ax_t, ax_k):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path, dpi)


def plot_learner(series: Mapping[str, tuple[list[int], list[float]]], path: Path, dpi: int) -> None:
    panels = [(names, title, ylabel) for names, title, ylabel in (
        (LOSS_METRICS, "Loss", "loss (token mean)"), (KL_METRICS, "KL", "KL (token mean, nats)"),
        (CLIP_METRICS, "Clip fraction", "clipped tokens (fraction)")) if any(n in series for n in names)]
    fig = Figure(figsize=(5 * len(panels), 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (names, title, ylabel) in zip(axes, panels):
        for name in names:
            if name in series:
                ax.plot(*series[name], marker=".", label=name)
        ax.set(title=title, xlabel="learner step", ylabel=ylabel)
        _integers(ax.xaxis)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Learner diagnostics per optimizer step")
    _save(fig, path, dpi)


def plot_before_after(table: Mapping[str, Mapping[str, Any]], path: Path, dpi: int) -> None:
    fig = Figure(figsize=(max(6, 2.4 * len(table) + 2), 4.8), layout="constrained")
    ax = fig.subplots()
    tasks, bar = list(table), 0.38
    for offset, side, color in ((-bar / 2, "before", "tab:gray"), (bar / 2, "after", "tab:orange")):
        xs = [i + offset for i, task in enumerate(tasks) if table[task][side]]
        cells = [table[task][side] for task in tasks if table[task][side]]
        if not cells:
            continue
        rates = [100 * c["rate"] for c in cells]
        err = [[r - 100 * c["ci95"][0] for r, c in zip(rates, cells)],   # below each bar
               [100 * c["ci95"][1] - r for r, c in zip(rates, cells)]]   # above each bar
        label = "first validation round (before)" if side == "before" else "last validation round (after)"
        ax.bar(xs, rates, bar, yerr=err, capsize=4, color=color, edgecolor="black", label=label)
        for x, c in zip(xs, cells):  # above the interval, where no bar or error bar is
            ax.annotate(f"round {c['round']}\nn={c['episodes']}", (x, 100 * c["ci95"][1] + 2), ha="center",
                        va="bottom", fontsize=8)
    # Under each task its paired change and verdict: what the bars alone cannot show.
    ax.set_xticks(range(len(tasks)),
                  [f"{task}\npaired change\n{format_change(table[task]['change'])}\n{table[task]['verdict']}"
                   if table[task].get("change") else task for task in tasks])
    ax.set(title="Held-out success before vs after training (95% Wilson intervals)", xlabel="task",
           ylabel="success rate (%)", ylim=(0, 118), yticks=range(0, 101, 20))
    ax.grid(alpha=0.3, axis="y")
    fig.legend(loc="outside lower center", ncols=2)
    _save(fig, path, dpi)


# ---------------------------------------------------------------- markdown

def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _interval(ci: Sequence[float]) -> str:
    return f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def _cell(p: Mapping[str, Any] | None) -> str:
    if p is None:
        return "—"
    return f"r{p['round']}: {p['successes']}/{p['episodes']} = {_pct(p['rate'])} {_interval(p['ci95'])}"


def _sentence(task: str, row: Mapping[str, Any]) -> str:
    """The plain-words verdict of one task."""
    before, after = row["before"], row["after"]
    if before is None:
        return f"- **{task}**: no validation rollouts, so no held-out result."
    if after is None:
        return (f"- **{task}**: evaluated in round {before['round']} only ({_cell(before)}); "
                "no later round to compare with yet.")
    if row.get("criterion") == "paired change":
        change = row["change"]
        lo, hi = change["ci95"]
        p = change.get("p_sign_flip")
        flip = "" if p is None else f" (sign-flip p = {p:.2g})"
        if row["verdict"] in ("improved", "worse"):
            judged = f"; the interval excludes zero and the sign-flip test agrees{flip}"
        elif lo > 0 or hi < 0:
            judged = (f"; the interval excludes zero but the sign-flip test does not{flip}: too few samples "
                      "changed to tell it from the noise")
        else:
            judged = "; the interval includes zero, so it is not clearly outside the noise"
        why = (f"paired over its {change['samples']} held-out samples the change is {format_change(change)} "
               f"({change['up']} samples rose, {change['down']} fell){judged}")
    else:
        why = ("the 95% intervals are disjoint" if row["intervals_disjoint"]
               else "the 95% intervals overlap, so by this criterion it is not clearly outside the noise")
    return (f"- **{task}**: {row['verdict']}: {_cell(before)} → {_cell(after)}; {why} "
            f"(z-test p = {row['p_value']:.2g}).")


def _p_sign_flip(change: Mapping[str, Any] | None) -> str:
    p = (change or {}).get("p_sign_flip")
    return "—" if p is None else f"{p:.2g}"


def format_change(change: Mapping[str, Any] | None) -> str:
    """A paired change in percentage points with its interval: "+5.6 pts [+1.7, +9.5]"."""
    if change is None:
        return "—"
    lo, hi = change["ci95"]
    return f"{100 * change['mean']:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


def _figure(name: str | None, alt: str, missing: str) -> list[str]:
    return [f"![{alt}]({name})", ""] if name else [f"_{missing}_", ""]


def _status_symbols() -> list[str]:
    """The Status enum's symbols in schema order (running, completed, then the failures)."""
    status = next(f["type"] for f in codec.codec().schema("trajectory")["fields"] if f["name"] == "status")
    return list(status["symbols"])


def _status_table(shares: Mapping[str, Any]) -> list[str]:
    seen = {s for row in shares["tasks"].values() for s in row["shares"]}
    statuses = [s for s in _status_symbols() if s in seen]
    rows = [[task, row["episodes"], *(_pct(row["shares"].get(s, 0.0)) for s in statuses)]
            for task, row in (*shares["tasks"].items(), ("**all**", shares["overall"]))]
    return _table(["task", "episodes", *statuses], rows)


def _evaluation_section(tasks: Mapping[str, Mapping[str, Any]], val: Sequence[Event], rounds: Mapping[str, int],
                        figure: str | None) -> list[str]:
    lines = ["## Held-out evaluation: before vs after training", "",
             "Success = session `completed` with full credit (env reward ≥ 1). "
             f"Criterion: {evaluation.VERDICT_CRITERION}.", ""]
    evaluated = {task: row for task, row in tasks.items() if row["before"] is not None}
    if evaluated:
        lines += _table(["task", "before: round: successes/episodes = rate [95% CI]", "after",
                         "change, paired per sample [95% CI]", "sign-flip p", "z-test p", "verdict"],
                        [[task, _cell(r["before"]), _cell(r["after"]), format_change(r.get("change")),
                          _p_sign_flip(r.get("change")),
                          "—" if r["p_value"] is None else f"{r['p_value']:.2g}", r["verdict"]]
                         for task, r in evaluated.items()])
    lines += [_sentence(task, row) for task, row in tasks.items()] or ["_No trajectories in this run yet._"]
    unresolved = len({t["group_id"] for t in val} - set(rounds))
    if unresolved:
        lines.append(f"- {unresolved} validation group(s) matched no validation round and are not counted.")
    lines += [""] + _figure(figure, "held-out success before and after",
                            "No validation rollouts yet: nothing to compare.")
    if rounds:
        last = max(rounds.values())
        rows = evaluation.repeat_table(t for t in val if rounds.get(t["group_id"]) == last)
        lines += [f"### Success per repeat, validation round {last} (paper Table 3 format)", ""]
        lines += _table(["task", "repeats", "success per repeat", "mean ± std"],
                        [[task, r["repeats"], ", ".join(_pct(x) for x in r["rates"]),
                          f"{_pct(r['mean'])} ± {_pct(r['std'])}"] for task, r in rows.items()])
    return lines


def _termination_section(train: Sequence[Event], val: Sequence[Event]) -> list[str]:
    lines = ["## Termination status (paper Table 7 format)", ""]
    for title, subset in (("Training", train), ("Validation", val)):
        lines += [f"### {title} trajectories", ""]
        lines += _status_table(evaluation.termination_shares(subset)) if subset else ["_None yet._", ""]
    return lines




def learning_signal(groups: Sequence[Event], metrics: Iterable[Event] = (),
                    validation_groups: Iterable[str] = ()) -> dict[str, dict[str, int]]:
    """Per task, training groups and how many had all-equal rewards: GRPO gives those zero advantage,
    so a task whose groups are all equal teaches the policy nothing (e.g. it never succeeds).

    With `streams.filter_all_equal` such groups never reach `groups`: the aggregator's drop metrics
    count them (`filtered`, included in `groups` and `all_equal`)."""
    out: dict[str, dict[str, int]] = {}
    for g in groups:
        if not g["validation"]:
            row = out.setdefault(g["task"], {"groups": 0, "all_equal": 0, "filtered": 0})
            row["groups"] += 1
            row["all_equal"] += bool(g["all_equal"])
    skip = set(validation_groups)
    filtered = {(m["labels"]["group_id"], m["labels"].get("task", "")) for m in metrics
                if m["name"] == topics.GROUP_DROPPED_METRIC and m["labels"].get("reason") == "all_equal"
                and m["labels"]["group_id"] not in skip}
    for _, task in filtered:  # a group id once, however often the drop was published
        row = out.setdefault(task, {"groups": 0, "all_equal": 0, "filtered": 0})
        for key in ("groups", "all_equal", "filtered"):
            row[key] += 1
    return dict(sorted(out.items()))


def _opt(x: float | None, fmt: str) -> str:
    return "—" if x is None else fmt.format(x)


def _dangerous(f: Mapping[str, Any]) -> str:
    """"3 (network 2, system_write 1)": the count, then per pattern."""
    by_pattern = ", ".join(f"{pattern} {n}" for pattern, n in f["dangerous_by_pattern"].items())
    return f"{f['dangerous_calls']} ({by_pattern})" if by_pattern else str(f["dangerous_calls"])


def _behaviour_section(figures: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """How the policy acted, per task (streams/behaviour.py defines each figure; the live metrics
    publish the same ones as streams/<figure>)."""
    lines = ["## Behaviour", "",
             "All rollouts of the run, training and validation. Invalid output: steps whose text did not parse "
             "into tool calls; truncated: steps stopped at the token limit; NLL/token: mean negative log-prob "
             "of the sampled tokens (a per-token entropy estimate); call success: calls whose step did not end "
             "the session as invalid action, invalid output or task error; tool errors: calls the environment "
             "refused or rejected, by its own count; repeated: calls identical to an earlier call of their trajectory; "
             "dangerous: calls holding a dangerous command (patterns in schemas/behaviour.py).", ""]
    if not figures:
        return lines + ["_No steps or trajectories yet._", ""]
    lines += _table(["task", "steps", "invalid output", "truncated", "tokens/step", "NLL/token", "calls",
                     "call success", "tool errors", "repeated", "dangerous"],
                    [[task, f["steps"], _opt(f["invalid_output_share"], "{:.1%}"),
                      _opt(f["truncation_share"], "{:.1%}"), _opt(f["response_tokens_per_step"], "{:.1f}"),
                      _opt(f["mean_token_nll"], "{:.3f}"), f["calls"],
                      _opt(f["call_success_rate"], "{:.1%}"), _opt(f["tool_error_share"], "{:.1%}"),
                      _opt(f["repeated_call_share"], "{:.1%}"), _dangerous(f)]
                     for task, f in figures.items()])
    tools = [[task, tool, t["calls"], _opt(t["success_rate"], "{:.1%}")]
             for task, f in figures.items() for tool, t in f["tools"].items()]
    if tools:
        lines += ["### Calls per tool", ""] + _table(["task", "tool", "calls", "call success"], tools)
    return lines


_ALERT_FIELDS = ("at_ms", "action", "rule", "task", "figure", "value", "direction", "threshold", "steps",
                 "trajectories", "source")


def alerts_summary(alerts: Sequence[Event]) -> dict[str, Any]:
    """summary.json's `alerts`: the run's alert events in log order (each once) and what they left the run
    in: the rule that stopped it, the rule whose pause no resume lifted."""
    hold = RunHold()
    events = [{f: a[f] for f in _ALERT_FIELDS} for a in alerts if hold.apply(a)]
    return {"events": events, "stopped_by": hold.stopped_by, "paused_by": hold.paused_by}


def _alerts_section(summary: Mapping[str, Any], t0_ms: int) -> list[str]:
    lines = ["## Alerts", "", "The behaviour alert rules of `streams.alerts` that fired (each once until its figure "
             "came back past the threshold), and resumes (ARCHITECTURE.md \"Alerts\").", ""]
    if summary["stopped_by"]:
        lines += [f"**The run was stopped by alert `{summary['stopped_by']}`.**", ""]
    if summary["paused_by"]:
        lines += [f"**The run ended paused by alert `{summary['paused_by']}`.**", ""]
    if not summary["events"]:
        return lines + ["_No alert fired._", ""]
    return lines + _table(
        ["minute", "action", "rule", "task", "figure", "value", "threshold", "steps", "trajectories"],
        [[f"{max(0, a['at_ms'] - t0_ms) / 60_000:.1f}", a["action"], a["rule"] or "—", a["task"], a["figure"] or "—",
          _opt(a["value"], "{:.3g}"), "—" if a["direction"] is None else f"{a['direction']} {a['threshold']:g}",
          a["steps"], a["trajectories"]] for a in summary["events"]])


def _training_section(train: Sequence[Event], signal: Mapping[str, Mapping[str, int]],
                      figure: str | None) -> list[str]:
    lines = ["## Training success and reward over learner versions", ""]
    if train:
        lines += _table(["task", "episodes", "success rate [95% CI]", "mean reward", "groups with equal rewards"],
                        [[task, r["episodes"], f"{_pct(r['success_rate'])} {_interval(r['ci95'])}",
                          f"{r['mean_reward']:.3f}",
                          _equal_groups(signal[task]) if task in signal else "—"]
                         for task, r in evaluation.success_by_task(train).items()])
        silent = [task for task, row in signal.items() if row["groups"] and row["all_equal"] == row["groups"]]
        if silent:
            lines += [f"No learning signal for {', '.join(silent)}: every training group's members got the same "
                      "reward, so every GRPO advantage was zero (typically: the policy never succeeds on the task "
                      "and every attempt gets the same punishment). Such a task cannot improve under RL until "
                      "the starting policy sometimes succeeds.", ""]
    return lines + _figure(figure, "training success and reward", "No training trajectories yet.")


def _equal_groups(row: Mapping[str, int]) -> str:
    text = f"{row['all_equal']} of {row['groups']}"
    return text + (f" ({row['filtered']} filtered out, not trained)" if row["filtered"] else "")


def _pipeline_sections(staleness: Sequence[int], turn_source: str, turns: Sequence[tuple[int, str]],
                       figures: Mapping[str, str | None]) -> list[str]:
    lines = ["## Staleness", "", "Per trained group: the learner version it was trained from minus the oldest "
             "weight version among its turns.", ""]
    if staleness:
        lines += [f"Mean {statistics.fmean(staleness):.2f}, max {max(staleness)} versions "
                  f"over {len(staleness)} groups.", ""]
    lines += _figure(figures["staleness"], "staleness histogram", "No trained batches yet.")
    lines += ["## Stale-turn share", ""]
    if turns:
        stale = sum(pool == "stale" for _, pool in turns)
        lines += [f"{stale} of {len(turns)} training turns ({_pct(stale / len(turns))}) came from the stale pool "
                  f"(counted from `{turn_source}`).", ""]
    lines += _figure(figures["stale_share"], "stale-turn share over time", "No training turns yet.")
    lines += ["## Throughput", ""] + _figure(figures["throughput"], "throughput over time",
                                             "No finished trajectories yet.")
    lines += ["## Learner: loss, KL, clip fraction", ""] + _figure(
        figures["learner"], "learner loss, KL and clip fraction", "No learner metrics yet.")
    return lines


# ---------------------------------------------------------------- the report

_NOT_VALIDATED = {"before": None, "after": None, "change": None, "criterion": None, "intervals_disjoint": False,
                  "p_value": None, "verdict": "no validation"}


def build_report(events: Events, out_dir: Path, run: str, *, config: Mapping[str, Any] | None = None,
                 settings: ReportSettings = ReportSettings()) -> dict[str, Any]:
    """Writes report.md, summary.json and the figures of `run` into out_dir; returns the summary.

    `events`: topic name -> decoded events (schemas/avro), optionally with `_timestamp_ms`.
    `config`: the run's configuration, shown in the report when given.
    """
    ev = run_events(events, run)
    trajs = ev.get(topics.TRAJECTORIES, [])
    train = [t for t in trajs if not t.get("validation", False)]
    val = [t for t in trajs if t.get("validation", False)]
    steps, groups = ev.get(topics.STEPS, []), ev.get(topics.GROUPS, [])
    requested = [r for r in ev.get(topics.TASKS_REQUESTED, []) if r.get("validation")]
    span = run_span_ms(ev)
    t0 = span[0] if span else 0
    dpi, bucket_s = settings.dpi, settings.time_bucket_s
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    def figure(name: str, draw: Callable[[Path], None], has_data: bool) -> str | None:
        if not has_data:
            return None
        draw(out_dir / name)
        written.append(name)
        return name

    # held-out evaluation: rounds from the dispatcher's requests, else from the group ids
    rounds = evaluation.validation_rounds(val, {r["group_id"]: int(r["epoch"]) for r in requested})
    table = evaluation.before_after(val, rounds)
    tasks = {task: table.get(task, dict(_NOT_VALIDATED)) for task in sorted({t["task"] for t in trajs} | set(table))}
    eval_fig = figure("evaluation.png", lambda p: plot_before_after(table, p, dpi), bool(table))

    # training curves and pipeline health
    versions = trajectory_versions(train, steps, groups)
    width, by_version = success_over_versions(train, versions, settings.version_buckets)
    curve_fig = figure("success_reward.png", lambda p: plot_success_over_versions(width, by_version, p, dpi),
                       bool(by_version))
    staleness = group_staleness(ev.get(topics.BATCHES, []), ev.get(topics.WEIGHTS, []), groups)
    val_groups = {t["group_id"] for t in val} | {r["group_id"] for r in requested}
    turn_source, turns = training_turns(steps, train, val_groups)
    signal = learning_signal(groups, ev.get(topics.METRICS, []), val_groups)
    share = stale_share_over_time(turns, t0, bucket_s)
    rate = throughput_over_time(trajs, t0, bucket_s)
    acted = {task: behaviour.figures(c) for task, c in behaviour.per_task(steps, trajs).items()}
    learner = learner_series(ev.get(topics.METRICS, []), (*LOSS_METRICS, *KL_METRICS, *CLIP_METRICS))
    health = {
        "staleness": figure("staleness.png", lambda p: plot_staleness(staleness, p, dpi), bool(staleness)),
        "stale_share": figure("stale_share.png", lambda p: plot_stale_share(share, bucket_s, p, dpi),
                              bool(share["minute"])),
        "throughput": figure("throughput.png", lambda p: plot_throughput(rate, bucket_s, p, dpi), bool(rate["minute"])),
        "learner": figure("learner.png", lambda p: plot_learner(learner, p, dpi), bool(learner)),
    }

    summary = {"run": run, "duration_s": (span[1] - span[0]) / 1000.0 if span else 0.0,
               "learner_steps": learner_steps(ev.get(topics.WEIGHTS, [])), "tasks": tasks,
               "trajectories": len(trajs), "figures": written, "learning_signal": signal, "behaviour": acted,
               "alerts": alerts_summary(ev.get(topics.ALERTS, []))}
    lines = [f"# Run `{run}`", "",
             f"- Duration: {summary['duration_s']:.0f} s (first to last event of the run)",
             f"- Learner steps: {summary['learner_steps']}",
             f"- Trajectories: {len(trajs)} ({len(train)} training, {len(val)} validation), duplicates dropped",
             f"- Groups trained: {len(staleness)}", ""]
    lines += _evaluation_section(tasks, val, rounds, eval_fig)
    lines += _termination_section(train, val)
    lines += _behaviour_section(acted)
    lines += _alerts_section(summary["alerts"], t0)
    lines += _training_section(train, signal, curve_fig)
    lines += _pipeline_sections(staleness, turn_source, turns, health)
    if config:  # last: long, and read only when a figure above needs explaining
        lines += ["## Configuration", "", "```json", json.dumps(config, indent=2, sort_keys=True, default=str),
                  "```", ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
