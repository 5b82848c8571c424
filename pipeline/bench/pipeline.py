"""`rollstream bench pipeline`: the same workload trained synchronously and asynchronously in one
invocation on the real stack, side by side, against the bound perfect overlap of its stages would reach.

1. **rollout alone** — fresh engines, the learner held stopped (SIGSTOP) from its start until enough
   groups are ready, every group the measurement needs let out at once: the stage's rate with the
   learner idle, at least as many rollouts at a time as the asynchronous mode keeps in flight;
2. **synchronous** — the standard RLVR loop: the dispatcher lets out one batch of groups, waits for
   the slowest trajectory, the learner trains and broadcasts, and only then is the next batch let
   out (`mix.max_in_flight_groups` = one batch; every engine in the current pool, staleness 0);
3. **asynchronous** — the normal pipeline: the workload's `mix.max_in_flight_groups` in flight (two
   batches by default), a current and a stale engine (the same number of engines), rollouts going on
   while the learner trains;
4. **learner alone** — the asynchronous mode's own batches, copied under a run id of their own, trained
   back to back by a learner process from the same initial policy with no engine running: the
   learner stage's rate on exactly the work the asynchronous mode trained, with nothing beside it.

Each run starts its own engines, so each is measured warm: the modes and the learner-alone replay after
`--warmup-steps` learner steps, the rollout run after the groups that end the rollouts begun on cold
engines (the method is in pipeline/bench/pipeline_logic.py, which computes every figure from the
runs' replayed events). Not the learner of the rollout run with its dispatcher held instead of a run
of its own: the batcher takes every group ready after the hold into one batch, and that learner then
waits for ever (tests/unit/test_batcher_held.py). Whenever async / bound exceeds 1 a warning says
whether by the noise of the stages alone or beyond it (the bound then does not hold); the figure is
never clamped.

The workload (configs/pipeline.yaml): calculator, DB and knowledge-graph tasks on a small random policy,
each family with its own heavy-tailed shape (`agent_loop.workload`, env_workers/workload.py): turns per
trajectory, new tokens per turn and environment step latency drawn log-normally per trajectory and turn,
so that a synchronous round waits for its longest trajectory, as the paper's long-tail rollouts do.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.bench.cpu import MachineCpuSampler
from pipeline.bench.pipeline_logic import (
    bound,
    bound_warnings,
    comparison,
    cores_bound,
    engine_intervals,
    learner_alone,
    learner_intervals,
    merged,
    mode_figures,
    replay_differences,
    replay_order,
    rollout_alone,
    stage_cpu,
)
from pipeline.policy.random_policy import ensure_random_policy
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from pipeline.run.plan import learner_child
from pipeline.run.up import RunFailed, Stack, run_up, timestamped
from schemas import topics
from schemas.bus import EventProducer

DEFAULT_CONFIG = REPO_ROOT / "configs" / "pipeline.yaml"
MODES = ("sync", "async")
ALONE = "rollout"
LEARNER = "learner"
READ = (topics.TASKS_REQUESTED, topics.STEPS, topics.GROUPS, topics.BATCHES, topics.WEIGHTS, topics.METRICS)
POLL_S = 3.0
LEARNER_LIMIT_S = 3600.0
"""The longest the learner-alone replay may take."""
HOLD_LIMIT_S = 900.0
"""The longest the rollout run holds its learner stopped; then it is let go and the rate comes from
the groups ready so far (or there is none)."""


def rollout_groups(cfg: RollstreamConfig, steps: int) -> tuple[int, int]:
    """The rollout run's warm-up groups and measured groups. The warm-up is as many groups as fill
    every rollout slot (their trajectories began on cold engines); at least as many are measured as
    the modes train in their windows, and as many again stay queued behind them."""
    slots = cfg.env_workers.count * cfg.env_workers.concurrency
    skip = math.ceil(slots / cfg.streams.group_size)
    return skip, max(steps * cfg.streams.batch_size, skip)


def mode_config(base: RollstreamConfig, mode: str, steps: int, warmup_steps: int) -> RollstreamConfig:
    """The run of one mode: the same workload and engine count, the pipeline's shape apart. The rollout
    run lets out every group its measurement needs at once and trains one step after its hold."""
    data = base.as_data()
    engines = base.engines.current + base.engines.stale
    data["max_steps"] = warmup_steps + steps
    data["mix"] = {**data["mix"], "val_families": [], "val_interval": 1}
    if mode == "sync":
        data["engines"] = {**data["engines"], "current": engines, "stale": 0}
        data["mix"]["max_in_flight_groups"] = base.streams.batch_size
    elif mode == ALONE:
        skip, measured = rollout_groups(base, steps)
        data["max_steps"] = 1
        data["mix"]["max_in_flight_groups"] = 2 * skip + measured
    # the asynchronous mode keeps the workload's own bound (None: the dispatcher's default, two batches)
    return RollstreamConfig(**data)


class LearnerHold:
    """Holds the rollout run's learner stopped from its first version until `groups` groups of the
    run are ready (or HOLD_LIMIT_S passed), and its dispatcher stopped until the learner is: every
    rollout runs with the learner idle, none beside its start-up."""

    def __init__(self, cfg: RollstreamConfig, run: str, groups: int, say: Any) -> None:
        self.cfg, self.run, self.groups, self.say = cfg, run, groups, say
        self.since_ms = int(time.time() * 1000) - 5000
        self.state, self._stopped_at, self._last_poll = "starting", 0.0, 0.0

    def tick(self, stack: Stack, snap: dict[str, Any]) -> None:
        if self.state == "released" or (self.state != "starting" and time.monotonic() - self._last_poll < POLL_S):
            return
        self._last_poll = time.monotonic()
        learner = next(c for c in stack.children if c.child.name == "learner")
        dispatcher = next(c for c in stack.children if c.child.name == "dispatcher")
        if self.state == "starting":
            os.killpg(dispatcher.process.pid, signal.SIGSTOP)
            self.state = "learner starting"
        elif self.state == "learner starting" and self._ids(topics.WEIGHTS, "version"):
            os.killpg(learner.process.pid, signal.SIGSTOP)
            os.killpg(dispatcher.process.pid, signal.SIGCONT)
            self.state, self._stopped_at = "held", time.monotonic()
            self.say(f"rollout: learner held after version 0 until {self.groups} groups are ready")
        elif self.state == "held":
            ready = len(self._ids(topics.GROUPS, "group_id"))
            if ready >= self.groups or time.monotonic() - self._stopped_at > HOLD_LIMIT_S:
                os.killpg(learner.process.pid, signal.SIGCONT)
                self.state = "released"
                self.say(f"rollout: {ready} groups ready in {time.monotonic() - self._stopped_at:.0f} s; learner let go")

    def _ids(self, topic: str, key: str) -> set[Any]:
        from pipeline.analysis.replay import Bound, read_topic  # noqa: PLC0415

        return {r.value[key] for r in read_topic(self.cfg.kafka, topic, run=self.run,
                                                 start=Bound(timestamp_ms=self.since_ms))}


def _prefixed(stage: str, figures: dict[str, Any]) -> dict[str, Any]:
    return {f"{stage}_{key}": value for key, value in figures.items()}


def _cores_said(busy: float | None) -> str:
    return "" if busy is None else f", the machine's cores {busy:.0%} busy"


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
        # the share of the machine's cores busy between samples, drawn as a filled curve in a row of its own
        cpu = tl.get("cpu") or []
        pairs = [(a, b) for a, b in zip(cpu, cpu[1:]) if b[0] > a[0] and b[0] > start and a[0] < tl["end_ms"]]
        if pairs:
            xs = [((a[0] + b[0]) / 2 - start) / 1000 for a, b in pairs]
            shares = [min(1.0, (b[1] - a[1]) * 1000 / ((b[0] - a[0]) * tl["cores"])) for a, b in pairs]
            base = len(rows) - 0.35
            ax.fill_between(xs, base, [base + 0.7 * v for v in shares], color="tab:gray", step="mid", linewidth=0)
            rows.append(("cores busy", [], "tab:gray"))
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.set_xlim(0, (tl["end_ms"] - start) / 1000)
        ax.set_title(f"{mode}: busy intervals (generation on engines, steps on the learner) and the share of the "
                     "machine's cores busy", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first dispatched task")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _events(cfg: RollstreamConfig, mode_cfg: RollstreamConfig, mode_run: str, mode: str, console: Console,
            on_tick: Any = None) -> dict[str, list[dict[str, Any]]]:
    """One run to its end, and its replayed events by topic."""
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415

    summary = run_up(mode_cfg, mode_run, console=console, live=False, on_tick=on_tick)
    if summary["outcome"] != "finished":
        raise RunFailed(f"the {mode} run ended {summary['outcome']}")
    records = read_run(cfg.kafka, mode_run, READ, start=Bound.parse(summary["started_at"]))
    return {t: [r.value for r in recs] for t, recs in records.items()}


def _replay_learner(cfg: RollstreamConfig, learner_run: str, batches: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A learner process alone, from the run's initial policy, on `batches` copied under `learner_run`
    (already waiting in `batches` when it starts, so it trains them back to back); its replayed events."""
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415

    started_ms = int(time.time() * 1000) - 5000
    producer = EventProducer(cfg.kafka, client_id=f"bench-{learner_run}")
    for batch in batches:
        producer.send(topics.BATCHES, {**batch, "run": learner_run}, key=learner_run)
    producer.flush()
    run_dir = cfg.run_dir(learner_run)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    replay_cfg = RollstreamConfig(**{**cfg.as_data(), "max_steps": len(batches)})
    stack = Stack(log_dir)
    learner = stack.start(learner_child(replay_cfg, learner_run, run_dir, cfg.policy_dir(), {}, 0))
    try:
        code = learner.process.wait(timeout=LEARNER_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"the learner-alone replay did not finish within {LEARNER_LIMIT_S:.0f} s") from None
    finally:
        stack.stop(lambda line: None)
    if code != 0:
        raise RunFailed(f"the learner-alone replay exited with {code}:\n{learner.log_tail()}")
    records = read_run(cfg.kafka, learner_run, (topics.BATCHES, topics.WEIGHTS, topics.METRICS),
                       start=Bound(timestamp_ms=started_ms))
    return {t: [r.value for r in recs] for t, recs in records.items()}


def run_pipeline_bench(cfg: RollstreamConfig, steps: int, run: str, console: Console,
                       warmup_steps: int = 1) -> dict[str, Any]:
    # the machine's CPU, sampled through every run: what the cores did in each stage's and mode's window
    with MachineCpuSampler() as cpu:
        return _run_pipeline_bench(cfg, steps, run, console, warmup_steps, cpu)


def _run_pipeline_bench(cfg: RollstreamConfig, steps: int, run: str, console: Console, warmup_steps: int,
                        cpu: MachineCpuSampler) -> dict[str, Any]:
    from pipeline.analysis.replay_columns import action_tokens  # noqa: PLC0415

    say = timestamped(console)
    skip, measured = rollout_groups(cfg, steps)
    alone_cfg = mode_config(cfg, ALONE, steps, warmup_steps)
    say(f"{ALONE}: run {run}-{ALONE}, learner held, {alone_cfg.mix.max_in_flight_groups} groups let out at once; "
        f"{skip} groups of warm-up, {measured} measured")
    hold = LearnerHold(cfg, f"{run}-{ALONE}", 2 * skip + measured, say)
    events = _events(cfg, alone_cfg, f"{run}-{ALONE}", ALONE, console, hold.tick)
    rollout = rollout_alone(groups=events[topics.GROUPS], action_tokens=action_tokens, skip=skip, measured=measured,
                            per_batch=cfg.streams.batch_size)
    rollout |= _prefixed("rollout", stage_cpu(cpu.samples, [rollout["rollout_window_ms"]], rollout["rollout_tokens"],
                                              cpu.cores))
    say(f"{ALONE}: {rollout['rollout_tokens_per_s']:.1f} trained tokens/s alone over "
        f"{rollout['rollout_window_s']:.0f} s{_cores_said(rollout['rollout_cpu_busy'])}")

    def learner_kwargs(events: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        return dict(batches=events[topics.BATCHES], weights=events[topics.WEIGHTS], metrics=events[topics.METRICS],
                    action_tokens=action_tokens, warmup_steps=warmup_steps)

    figures: dict[str, dict[str, Any]] = {}
    timelines: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for mode in MODES:
        mode_cfg = mode_config(cfg, mode, steps, warmup_steps)
        say(f"{mode}: run {run}-{mode}, {warmup_steps} + {steps} learner steps, engines current "
            f"{mode_cfg.engines.current} stale {mode_cfg.engines.stale}, at most "
            f"{mode_cfg.mix.max_in_flight_groups or 2 * mode_cfg.streams.batch_size} groups in flight")
        events = runs[mode] = _events(cfg, mode_cfg, f"{run}-{mode}", mode, console)
        kwargs = learner_kwargs(events)
        figures[mode] = mode_figures(requested=[r for r in events[topics.TASKS_REQUESTED] if not r["validation"]],
                                     steps=events[topics.STEPS], **kwargs)
        # the learner's rate in the mode's own steps (beside the rollouts in the asynchronous mode)
        figures[mode]["learner_step_tokens_per_s"] = learner_alone(**kwargs)["learner_tokens_per_s"]
        figures[mode] |= stage_cpu(cpu.samples, [(figures[mode]["start_ms"], figures[mode]["end_ms"])],
                                   figures[mode]["trained_tokens"], cpu.cores)
        timelines[mode] = {"start_ms": figures[mode]["start_ms"], "end_ms": figures[mode]["end_ms"],
                           "engines": engine_intervals(events[topics.STEPS]),
                           "learner": list(learner_intervals(events[topics.METRICS]).values()),
                           "cpu": list(cpu.samples), "cores": cpu.cores}
        say(f"{mode}: {figures[mode]['trained_tokens_per_s']:.1f} trained tokens/s over {figures[mode]['wall_s']:.0f} s "
            f"after the warm-up{_cores_said(figures[mode]['cpu_busy'])}")
    learner_run = f"{run}-{LEARNER}"
    replayed = replay_order(runs["async"][topics.BATCHES], runs["async"][topics.WEIGHTS])
    say(f"{LEARNER}: run {learner_run}, the asynchronous run's {len(replayed)} batches replayed by a learner alone "
        f"(no engine), {warmup_steps} of them warm-up")
    learner_events = _replay_learner(cfg, learner_run, replayed)
    learner = learner_alone(**learner_kwargs(learner_events))
    measured_steps = [iv for step, iv in learner_intervals(learner_events[topics.METRICS]).items()
                      if step > warmup_steps]
    learner |= _prefixed("learner", stage_cpu(cpu.samples, measured_steps, learner["learner_tokens"], cpu.cores))
    say(f"{LEARNER}: {learner['learner_tokens_per_s']:.1f} trained tokens/s alone over {learner['learner_steps']} steps"
        f"{_cores_said(learner['learner_cpu_busy'])}")
    alone = bound(rollout, learner)
    alone["cores"] = cpu.cores
    alone["cores_bound_tokens_per_s"] = cores_bound(rollout["rollout_cpu_s_per_token"],
                                                    learner["learner_cpu_s_per_token"], cpu.cores)
    result = comparison(figures["sync"], figures["async"], alone)
    layout = replay_differences(learner_events[topics.WEIGHTS], runs["async"][topics.WEIGHTS], warmup_steps)
    warnings = bound_warnings(result)
    for line in layout + warnings:
        say(f"[yellow]warning: {escape(line)}[/yellow]")
    out_dir = cfg.run_dir(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(timelines, out_dir / "timeline.png")
    return {"run": run, **result, "bound_warnings": warnings, "replay_differences": layout, "modes": figures,
            "stages_alone": alone, "figure": str(out_dir / "timeline.png"),
            "workload": {"steps": steps, "warmup_steps": warmup_steps, "families": cfg.mix.families,
                         "group_size": cfg.streams.group_size, "batch_size": cfg.streams.batch_size,
                         "max_turns": cfg.agent_loop.max_turns, "max_new_tokens": cfg.agent_loop.max_new_tokens,
                         "step_latency": cfg.agent_loop.step_latency.model_dump(),
                         "shapes": [shape.model_dump() for shape in cfg.agent_loop.workload]}}


def print_result(result: dict[str, Any], console: Console) -> None:
    w = result["workload"]
    table = Table(title=f"bench pipeline — run {result['run']} ({w['steps']} measured learner steps per mode, "
                        f"after {w['warmup_steps']} of warm-up)")
    table.add_column("figure")
    for mode in MODES:
        table.add_column(mode, justify="right")
    rows = [("trained tokens/s", "trained_tokens_per_s", "{:.1f}"), ("trajectories/s", "trajectories_per_s", "{:.2f}"),
            ("engine busy", "engine_busy", "{:.0%}"), ("learner busy", "learner_busy", "{:.0%}"),
            ("learner tokens/s in its steps", "learner_step_tokens_per_s", "{:.1f}"),
            ("mean staleness (versions)", "mean_staleness", "{:.2f}"), ("wall (s)", "wall_s", "{:.0f}"),
            ("the machine's cores busy", "cpu_busy", "{:.0%}")]
    for label, key, fmt in rows:
        table.add_row(label, *("-" if result["modes"][m].get(key) is None else fmt.format(result["modes"][m][key])
                               for m in MODES))
    console.print(table)
    alone = result["stages_alone"]
    console.print(f"stages alone: rollout {alone['rollout_tokens_per_s']:.1f} (learner held), learner "
                  f"{alone['learner_tokens_per_s']:.1f} (the asynchronous run's batches replayed, no engine) trained "
                  f"tokens/s; bound {alone['bound_tokens_per_s']:.1f} (noise allows async up to "
                  f"{result['of_bound_noise_limit'] or 0:.0%} of it)")
    if alone.get("cores_bound_tokens_per_s"):
        console.print(f"the cores' estimate: {alone['cores']} cores / (rollout "
                      f"{alone['rollout_cpu_s_per_token'] * 1000:.2f} + learner "
                      f"{alone['learner_cpu_s_per_token'] * 1000:.2f} CPU ms per trained token, each alone) = "
                      f"{alone['cores_bound_tokens_per_s']:.1f} trained tokens/s; async / the lower of the two bounds: "
                      f"{result['of_cores_bound']:.0%}")
    ratio, of_bound = result["ratio"], result["of_bound"]
    console.print(f"async / sync: {ratio:.2f}x; async / bound: {of_bound:.0%} in tokens, "
                  f"{result['of_bound_trajectories']:.0%} in trajectories; timeline {result['figure']}"
                  if ratio is not None and of_bound is not None else "no ratio: a mode trained nothing")


def bench_pipeline(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="The workload (default: configs/pipeline.yaml)."),
    steps: int = typer.Option(8, "--steps", min=1, help="Measured learner steps per mode."),
    warmup_steps: int = typer.Option(1, "--warmup-steps", min=1, help="Learner steps per mode before its "
                                     "measured window (fresh engines compile and warm their caches)."),
    run: str = typer.Option("", "--run", help="Run id prefix (default: pipeline-<time>); the runs add -rollout, -learner, -sync, -async."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (ratio: async / sync)."),
) -> None:
    """Measure the rollout stage alone, train the same workload synchronously and asynchronously, then replay
    the asynchronous run's batches for the learner alone; print each mode's warm throughput, busy fractions and staleness, the ratio, and the share of the
    bound set by the slower stage alone.

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
        result = run_pipeline_bench(cfg, steps, run or time.strftime("pipeline-%Y%m%d-%H%M%S"), console,
                                    warmup_steps)
    except (RunFailed, ValueError) as error:
        console.print(f"[red]rollstream bench pipeline: {error}[/red]")
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_result(result, console)
