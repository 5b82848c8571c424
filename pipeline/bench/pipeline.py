"""`rollstream bench pipeline`: the same workload trained twice in one invocation on the real stack,
synchronously and asynchronously, side by side.

1. **synchronous** — the standard RLVR loop: the dispatcher lets out one batch of groups, waits for
   the slowest trajectory, the learner trains and broadcasts, and only then is the next batch let
   out (`mix.max_in_flight_groups` = one batch; every engine in the current pool, staleness 0);
2. **asynchronous** — the normal pipeline: two batches in flight, a current and a stale engine
   (the same number of engines), rollouts going on while the learner trains.

The workload (configs/pipeline.yaml): calculator and DB tasks on a small random policy, turn counts
from 1 to max_turns as the policy ends them, and a log-normal environment step latency
(`agent_loop.step_latency`, median 1 s, sigma 1: p99 near 10 s), the heavy tail AgentRL and ROLL
measure in agentic environments. Figures come from each run's replayed events
(pipeline/bench/pipeline_logic.py); the synchronous run, whose phases never overlap, also gives
each stage's rate alone and so the bound perfect overlap would reach.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from pipeline.bench.faults import ensure_random_policy
from pipeline.bench.pipeline_logic import (
    comparison,
    engine_intervals,
    learner_intervals,
    merged,
    mode_figures,
    stages_alone,
)
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from pipeline.run.up import RunFailed, run_up, timestamped
from schemas import topics

DEFAULT_CONFIG = REPO_ROOT / "configs" / "pipeline.yaml"
MODES = ("sync", "async")
READ = (topics.TASKS_REQUESTED, topics.STEPS, topics.BATCHES, topics.WEIGHTS, topics.METRICS)


def mode_config(base: RollstreamConfig, mode: str, steps: int) -> RollstreamConfig:
    """The run of one mode: the same workload and engine count, the pipeline's shape apart."""
    data = base.as_data()
    engines = base.engines.current + base.engines.stale
    data["max_steps"] = steps
    data["mix"] = {**data["mix"], "val_families": [], "val_interval": 1}
    if mode == "sync":
        data["engines"] = {**data["engines"], "current": engines, "stale": 0}
        data["mix"]["max_in_flight_groups"] = base.streams.batch_size
    else:
        data["mix"]["max_in_flight_groups"] = None  # the dispatcher's default: two batches
    return RollstreamConfig(**data)


def _plot(timelines: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 2.2 * len(timelines) + 0.6), dpi=120, squeeze=False)
    for ax, (mode, tl) in zip(axes[:, 0], timelines.items()):
        start = tl["start_ms"]
        rows = [(f"engine {e}", iv, "tab:blue") for e, iv in sorted(tl["engines"].items())]
        rows.append(("learner", tl["learner"], "tab:orange"))
        for y, (label, intervals, colour) in enumerate(rows):
            ax.broken_barh([((a - start) / 1000, (b - a) / 1000) for a, b in merged(intervals)], (y - 0.35, 0.7),
                           color=colour)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.set_xlim(0, (tl["end_ms"] - start) / 1000)
        ax.set_title(f"{mode}: busy intervals (generation on engines, steps on the learner)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first dispatched task")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_pipeline_bench(cfg: RollstreamConfig, steps: int, run: str, console: Console) -> dict[str, Any]:
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415
    from pipeline.analysis.replay_columns import action_tokens

    say = timestamped(console)

    figures: dict[str, dict[str, Any]] = {}
    timelines: dict[str, dict[str, Any]] = {}
    alone: dict[str, float] = {}
    for mode in MODES:
        mode_cfg = mode_config(cfg, mode, steps)
        mode_run = f"{run}-{mode}"
        say(f"{mode}: run {mode_run}, {steps} learner steps, engines current {mode_cfg.engines.current} "
            f"stale {mode_cfg.engines.stale}, at most {mode_cfg.mix.max_in_flight_groups or 'two batches of'} "
            f"groups in flight")
        summary = run_up(mode_cfg, mode_run, console=console, live=False)
        if summary["outcome"] != "finished":
            raise RunFailed(f"the {mode} run ended {summary['outcome']}")
        records = read_run(cfg.kafka, mode_run, READ, start=Bound.parse(summary["started_at"]))
        events = {t: [r.value for r in recs] for t, recs in records.items()}
        kwargs = dict(requested=[r for r in events[topics.TASKS_REQUESTED] if not r["validation"]],
                      batches=events[topics.BATCHES], weights=events[topics.WEIGHTS], metrics=events[topics.METRICS],
                      action_tokens=action_tokens)
        figures[mode] = mode_figures(steps=events[topics.STEPS], **kwargs)
        if mode == "sync":
            alone = stages_alone(**kwargs)
        timelines[mode] = {"start_ms": figures[mode]["start_ms"], "end_ms": figures[mode]["end_ms"],
                           "engines": engine_intervals(events[topics.STEPS]),
                           "learner": list(learner_intervals(events[topics.METRICS]).values())}
        say(f"{mode}: {figures[mode]['trained_tokens_per_s']:.1f} trained tokens/s over {figures[mode]['wall_s']:.0f} s")
    out_dir = cfg.run_dir(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(timelines, out_dir / "timeline.png")
    return {"run": run, **comparison(figures["sync"], figures["async"], alone), "modes": figures,
            "stages_alone": alone, "figure": str(out_dir / "timeline.png"),
            "workload": {"steps": steps, "families": cfg.mix.families, "group_size": cfg.streams.group_size,
                         "batch_size": cfg.streams.batch_size, "max_turns": cfg.agent_loop.max_turns,
                         "step_latency": cfg.agent_loop.step_latency.model_dump()}}


def print_result(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench pipeline — run {result['run']} ({result['workload']['steps']} learner steps per mode)")
    table.add_column("figure")
    for mode in MODES:
        table.add_column(mode, justify="right")
    rows = [("trained tokens/s", "trained_tokens_per_s", "{:.1f}"), ("trajectories/s", "trajectories_per_s", "{:.2f}"),
            ("engine busy", "engine_busy", "{:.0%}"), ("learner busy", "learner_busy", "{:.0%}"),
            ("mean staleness (versions)", "mean_staleness", "{:.2f}"), ("wall (s)", "wall_s", "{:.0f}")]
    for label, key, fmt in rows:
        table.add_row(label, *(fmt.format(result["modes"][m][key]) for m in MODES))
    console.print(table)
    alone = result["stages_alone"]
    console.print(f"stages alone (from the synchronous run): rollout {alone['rollout_tokens_per_s']:.1f}, "
                  f"learner {alone['learner_tokens_per_s']:.1f} trained tokens/s; bound "
                  f"{alone['bound_tokens_per_s']:.1f}")
    ratio, of_bound = result["ratio"], result["of_bound"]
    console.print(f"async / sync: {ratio:.2f}x; async / bound: {of_bound:.0%}; timeline {result['figure']}"
                  if ratio is not None and of_bound is not None else "no ratio: a mode trained nothing")


def bench_pipeline(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="The workload (default: configs/pipeline.yaml)."),
    steps: int = typer.Option(8, "--steps", min=2, help="Learner steps per mode."),
    run: str = typer.Option("", "--run", help="Run id prefix (default: pipeline-<time>); the modes add -sync, -async."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (ratio: async / sync)."),
) -> None:
    """Train the same workload synchronously, then asynchronously; print each mode's throughput, busy
    fractions and staleness, the ratio, and the share of the bound set by the slower stage alone.

    Example: rollstream bench pipeline --steps 8 --json
    """
    try:
        cfg = load_config(config)
    except (ValueError, OSError) as error:
        typer.echo(f"rollstream bench pipeline: {error}", err=True)
        raise typer.Exit(code=2) from None
    ensure_random_policy(cfg.policy_dir())
    console = Console(stderr=True)
    try:
        result = run_pipeline_bench(cfg, steps, run or time.strftime("pipeline-%Y%m%d-%H%M%S"), console)
    except (RunFailed, ValueError) as error:
        console.print(f"[red]rollstream bench pipeline: {error}[/red]")
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_result(result, console)
