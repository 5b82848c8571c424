"""`rollstream bench scale`: env workers are Kafka consumers, so adding one adds rollout capacity.

One current-pool engine serves a small random policy; calculator tasks go straight onto `tasks`
(the env workers' input; a backlog is kept so no worker ever waits for work); environment steps
carry a log-normal latency (env_workers/workload.py) so that, as in real agentic tasks, waiting on
the environment dominates and CPU is not the limit. Env workers are started one at a time; after
each start the consumer group rebalances, and once it is stable (every worker holds partitions)
and `--settle` seconds have passed, trajectories/s is measured over `--window` seconds from the
`trajectories` topic. At the end every worker drains and stops, and every task is accounted for
from the topics (pipeline/bench/scale_logic.py): none may be lost, and a task rolled out again by a
rebalance must carry the same content.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.table import Table

from env_workers.workload import StepLatency
from env_workers.settings import AgentLoopSettings
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.analysis.replay_verify import VerifySettings, same_content
from pipeline.bench.scale_logic import account_tasks, scale_figures, window_rate
from pipeline.dispatch.logic import Slot, requests_for
from pipeline.engine.launch import launch_engine, stop_process_group
from pipeline.policy.random_policy import ensure_random_policy
from pipeline.run.config import REPO_ROOT, load_config, settings_json, write_private
from pipeline.run.plan import command
from pipeline.run.up import timestamped
from schemas import topics
from schemas.bus import EventConsumer, EventProducer
from schemas.ids import trajectory_id
from streams.routing import RoutingPlan, task_event

CALC_TRAIN_TASKS = 5000


class TaskFeed:
    """Publishes calculator tasks of one run onto `tasks`, keeping `backlog` of them unfinished."""

    def __init__(self, producer: EventProducer, run: str, max_turns: int, backlog: int) -> None:
        self.producer, self.run, self.max_turns, self.backlog = producer, run, max_turns, backlog
        self.published: list[tuple[int, int, str]] = []  # (partition, offset, trajectory id)
        self._next = 0

    def top_up(self, finished: int) -> None:
        missing = self.backlog - (self._next - finished)
        if missing <= 0:
            return
        now = int(time.time() * 1000)
        for _ in range(missing):
            slot = Slot("calc", "train", self._next % CALC_TRAIN_TASKS, self._next // CALC_TRAIN_TASKS)
            request = requests_for(self.run, slot, 1, False, 0, now)[0]
            plan = RoutingPlan(["current"] * self.max_turns, seed=0, stale_ratio=0.0, reason="bench scale",
                               stale_version=None)
            tid = trajectory_id(self.run, request["group_id"], 0)

            def delivered(error: Any, msg: Any, tid: str = tid) -> None:
                if error is None:
                    self.published.append((msg.partition(), msg.offset(), tid))

            self.producer.send(topics.TASKS, task_event(request, plan, now), key=request["group_id"],
                               on_delivery=delivered)
            self._next += 1
        self.producer.flush()


class TrajectoryCount:
    """The run's trajectory events from the topic's end at start: (timestamp, event)."""

    def __init__(self, kafka: Any, run: str) -> None:
        self.run = run
        self.consumer = EventConsumer(kafka, f"bench-scale-tap-{uuid.uuid4().hex}", [])
        self.consumer.assign({topics.TRAJECTORIES: self.consumer.end_offsets(topics.TRAJECTORIES)})
        self.events: list[tuple[int, dict[str, Any]]] = []

    def poll(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            event = self.consumer.poll(min(left, 0.5))
            if event is not None and event.value["run"] == self.run:
                self.events.append((event.timestamp_ms, event.value))

    @property
    def distinct(self) -> int:
        return len({e["trajectory_id"] for _, e in self.events})


def group_members(admin: AdminClient, group: str) -> tuple[str, list[int]]:
    """The group's state and, per member, how many partitions it holds."""
    description = admin.describe_consumer_groups([group])[group].result(timeout=10)
    state = description.state.name if isinstance(description.state, ConsumerGroupState) else str(description.state)
    return state, [len(m.assignment.topic_partitions) for m in description.members]


def committed_offsets(kafka: Any, group: str) -> dict[int, int]:
    consumer = EventConsumer(kafka, group, [])
    try:
        return consumer.committed(topics.TASKS)
    finally:
        consumer.close()


def _plot(curve: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in curve]
    rates = [r["trajectories_per_s"] for r in curve]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(workers, rates, "o-", label="measured")
    ax.plot(workers, [rates[0] * w for w in workers], "--", color="grey", label="linear (k x one worker)")
    ax.set_xlabel("env workers (consumers of one group)")
    ax.set_ylabel("trajectories / s")
    ax.set_xticks(workers)
    ax.set_ylim(bottom=0)
    ax.set_title("Rollout throughput as env workers are added")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _feed_for(count: TrajectoryCount, feed: TaskFeed, seconds: float) -> None:
    """Reads trajectories and keeps the task backlog topped up for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        count.poll(1.0)
        feed.top_up(count.distinct)


def _start_env_worker(k: int, run: str, model: Path, settings_path: Path, logs: Path) -> subprocess.Popen:
    """The run's k-th env worker, in a session of its own (SIGKILL takes it whole), logging to `logs`."""
    log = open(logs / f"env-worker-{k}.log", "wb")
    return subprocess.Popen(
        command("env_worker", "--run", run, "--model", str(model), "--settings", str(settings_path),
                "--worker-id", f"{run}-w{k}"),
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_settled(workers: list[subprocess.Popen], admin: AdminClient, group: str, count: TrajectoryCount,
                  feed: TaskFeed, logs: Path) -> list[int]:
    """Feeds until the group is stable with every worker holding partitions (up to 180 s); the
    partitions each holds."""
    deadline = time.monotonic() + 180
    while True:
        count.poll(1.0)
        feed.top_up(count.distinct)
        if any(w.poll() is not None for w in workers):
            raise RuntimeError(f"an env worker exited: see {logs}")
        state, held = group_members(admin, group)
        if state == "STABLE" and len(held) == len(workers) and all(held):
            return held
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group did not settle with {len(workers)} workers ({state}, {held})")


def _measure_window(count: TrajectoryCount, feed: TaskFeed, settle_s: float, window_s: float) -> float:
    """Trajectories/s over `window_s` after `settle_s` of feeding."""
    _feed_for(count, feed, settle_s)
    start_ms = int(time.time() * 1000)
    _feed_for(count, feed, window_s)
    end_ms = int(time.time() * 1000)
    count.poll(2.0)  # events stamped inside the window that were still on their way
    return window_rate((t for t, _ in count.events), start_ms, end_ms)


def _stop_workers(workers: list[subprocess.Popen]) -> None:
    """SIGTERM to every worker (they drain and commit), SIGKILL to one still running after 180 s."""
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(w.pid, signal.SIGKILL)


def run_scale(*, max_workers: int, concurrency: int, latency: StepLatency, max_turns: int, window_s: float,
              settle_s: float, out_dir: Path, run: str, console: Console) -> dict[str, Any]:
    say = timestamped(console)
    cfg = load_config()
    model = cfg.policy_dir() if (cfg.policy_dir() / "config.json").is_file() else REPO_ROOT / ".run/models/bench-random"
    ensure_random_policy(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    group = f"{EnvWorkerSettings().group_id}.{run}"
    engine = launch_engine(pool="current", model_dir=model, run=run, work_dir=out_dir / "engines",
                           engine_id=f"{run}.current-0", cwd=REPO_ROOT, extra_args=("--max-model-len", "4096"))
    workers: list[subprocess.Popen] = []
    admin = AdminClient(cfg.kafka.as_confluent())
    producer = EventProducer(cfg.kafka, client_id="bench-scale")
    count = TrajectoryCount(cfg.kafka, run)
    feed = TaskFeed(producer, run, max_turns, backlog=3 * concurrency * max_workers)
    settings = EnvWorkerSettings(
        max_concurrency=concurrency, engine_urls={"current": [engine.url]}, model=str(model), env=load_config().envs,
        agent_loop=AgentLoopSettings(max_turns=max_turns, max_total_len=4096, max_new_tokens=8, step_latency=latency))
    settings_path = out_dir / "env-worker.json"
    write_private(settings_path, settings_json(settings))
    rates: list[float] = []
    try:
        seconds = engine.wait_until_serving(600)
        say(f"engine serving after {seconds:.0f} s; environment latency: median {latency.median_s} s, "
            f"sigma {latency.sigma}; {concurrency} rollouts per worker")
        feed.top_up(0)
        for k in range(1, max_workers + 1):
            workers.append(_start_env_worker(k, run, model, settings_path, logs))
            held = _wait_settled(workers, admin, group, count, feed, logs)
            say(f"{k} worker(s): group stable, partitions {sorted(held, reverse=True)}; measuring")
            rates.append(_measure_window(count, feed, settle_s, window_s))
            say(f"{k} worker(s): {rates[-1]:.2f} trajectories/s")
    finally:
        _stop_workers(workers)
        stop_process_group(engine.process, 60)
    count.poll(3.0)
    tolerance = VerifySettings().logprob_tolerance
    accounting = account_tasks(feed.published, committed_offsets(cfg.kafka, group), [e for _, e in count.events],
                               lambda a, b: same_content(a, b, tolerance))
    producer.close()
    count.consumer.close()
    figures = scale_figures(rates)
    _plot(figures["curve"], out_dir / "scale.png")
    return {"run": run, **figures, "tasks": accounting, "losses": accounting["losses"],
            "settings": {"max_workers": max_workers, "concurrency": concurrency, "max_turns": max_turns,
                         "window_s": window_s, "settle_s": settle_s, "latency": latency.model_dump()},
            "figure": str(out_dir / "scale.png")}


def print_result(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench scale — run {result['run']}")
    for col in ("env workers", "trajectories/s", "speed-up", "parallel efficiency", "added worker"):
        table.add_column(col, justify="right")
    for row in result["curve"]:
        table.add_row(str(row["workers"]), f"{row['trajectories_per_s']:.2f}",
                      f"{row['speedup']:.2f}x" if row["speedup"] is not None else "—",
                      f"{row['parallel_efficiency']:.0%}" if row["parallel_efficiency"] is not None else "—",
                      f"{row['added_worker_efficiency']:.0%}" if row["added_worker_efficiency"] is not None else "—")
    console.print(table)
    t = result["tasks"]
    console.print(f"mean efficiency per added worker: {result['ratio']:.0%}" if result["ratio"] is not None
                  else "one worker only: no efficiency per added worker")
    console.print(f"tasks: {t['tasks']} published, {t['completed']} done, {t['pending']} pending, {t['lost']} lost; "
                  f"{t['rolled_out_again']} rolled out again by rebalances ({t['copies_that_differ']} with "
                  f"another content); figure {result['figure']}")


def bench_scale(
    max_workers: int = typer.Option(4, "--max-workers", min=1, max=8, help="Env workers at the end (tasks has 8 partitions)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Rollouts in flight per worker."),
    median_s: float = typer.Option(1.0, "--median-s", min=0.0, help="Median environment step latency."),
    sigma: float = typer.Option(0.5, "--sigma", min=0.0, help="Std of log(latency): the tail's weight."),
    max_turns: int = typer.Option(3, "--max-turns", min=1, help="Assistant turns per trajectory."),
    window_s: float = typer.Option(40.0, "--window", min=5.0, help="Seconds measured per worker count."),
    settle_s: float = typer.Option(10.0, "--settle", min=0.0, help="Seconds after a rebalance before measuring."),
    run: str = typer.Option("", "--run", help="Run id (default: scale-<time>)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for scale.png and logs (default runs/<run>)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (ratio: mean efficiency per added worker)."),
) -> None:
    """Add env workers one at a time to one consumer group and measure trajectories/s after each
    rebalance; account for every task at the end (none lost). Needs Kafka up (`make infra-up`).

    Example: rollstream bench scale --max-workers 4 --json
    """
    run = run or time.strftime("scale-%Y%m%d-%H%M%S")
    cfg = load_config()
    console = Console(stderr=True)
    try:
        result = run_scale(max_workers=max_workers, concurrency=concurrency,
                           latency=StepLatency(median_s=median_s, sigma=sigma), max_turns=max_turns,
                           window_s=window_s, settle_s=settle_s, out_dir=out or cfg.run_dir(run), run=run,
                           console=console)
    except RuntimeError as error:
        console.print(f"[red]rollstream bench scale: {error}[/red]")
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_result(result, console)
    if result["losses"]:
        raise typer.Exit(code=1)
