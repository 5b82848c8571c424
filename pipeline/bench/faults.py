"""`rollstream bench faults`: a real training run (`rollstream up`'s machinery) with faults injected
one at a time, then `replay verify` over the run's topics.

The faults, their schedule and the figures are pure logic (pipeline/bench/faults_logic.py); this module
does the injecting: SIGKILL of a process group the run supervises (it is restarted: the learner
with --resume, an engine on the version its pool should hold), a restart of the broker or the
object store through the project's own infra scripts, undecodable events produced on every topic a
process of the run consumes. After the run: per fault the time to recover, the work redone (ids
published again), the losses, and the findings (a process that exited and was restarted during a
fault it should ride through, faults_logic.KILLS); both must be zero.

The default configuration (configs/faults.yaml) is a small CPU run on a randomly initialized policy:
this measures the pipeline, not learning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import typer
from confluent_kafka import Producer
from rich.console import Console
from rich.table import Table

from pipeline.bench.faults_logic import (
    FAULTS,
    KILLS,
    POISON_TOPICS,
    SCALED_DOWN,
    FaultSchedule,
    dead_letter_positions,
    fault_table,
    redone,
)
from pipeline.policy.random_policy import ensure_random_policy
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from pipeline.run.up import RunFailed, Stack, default_run_id, run_up, timestamped
from schemas import topics

DEFAULT_CONFIG = REPO_ROOT / "configs" / "faults.yaml"
POISON_VALUE = b"\x00rollstream bench faults: not an event"
KILLED_CHILD = {fault: name for fault, name in KILLS.items() if name is not None}
DLQ_POLL_S = 3.0
RECOVERY_AFTER_LAST_STEP_S = 120.0
"""A fault still open when the learner has finished gets this long (its dead letters may be on their
way), then counts as not recovered."""


class Injector:
    """Injects the schedule's faults from `run_up`'s tick and watches them recover."""

    def __init__(self, cfg: RollstreamConfig, run: str, schedule: FaultSchedule, say: Any) -> None:
        self.cfg, self.run, self.schedule, self.say = cfg, run, schedule, say
        self._last_dlq_poll = 0.0
        self._dead_letters: set[tuple[str, int, int]] = set()
        self._killed_engine: str | None = None

    def tick(self, stack: Stack, snap: dict[str, Any]) -> None:
        version, now = snap["learner_version"], int(time.time() * 1000)
        current = self.schedule.current
        if current is not None:
            if current.poison and time.monotonic() - self._last_dlq_poll > DLQ_POLL_S:
                self._poll_dlq(current.injected_at_ms)
            self.schedule.observe(version, now, self._dead_letters, self._back(current.name, stack))
            if self.schedule.current is None:
                self.say(f"[green]recovered[/green] from {current.name} in {current.recovery_s:.0f} s "
                         f"(learner at version {version})")
            return
        name = self.schedule.due(version)
        if name is None:
            return
        self.say(f"[yellow]injecting[/yellow] {name} at learner version {version}: {FAULTS[name]}")
        restarts = dict(stack.restarts)
        detail, poison = getattr(self, f"_{name}")(stack)
        killed = self._killed_engine if name == "engine_kill" else None
        self.schedule.injected(name, version, now, detail, poison, restarts, killed=killed)

    def _back(self, fault: str, stack: Stack) -> bool:
        """Whether what the fault hit is working again."""
        if fault in KILLED_CHILD:
            child = next(c for c in stack.children if c.child.name == KILLED_CHILD[fault])
            return child.process.poll() is None and stack.restarts.get(child.child.name, 0) > 0
        if fault == "engine_kill":
            engine = next(e for e in stack.engines if e.pool == "current")
            try:
                return engine.process.poll() is None and httpx.get(f"{engine.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        return True

    # -- the faults ---------------------------------------------------------------------------

    def _kill_child(self, stack: Stack, name: str) -> tuple[str, list]:
        child = next(c for c in stack.children if c.child.name == name)
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        return f"{name} (pid {child.process.pid}) killed", []

    def _env_worker_kill(self, stack: Stack) -> tuple[str, list]:
        return self._kill_child(stack, KILLED_CHILD["env_worker_kill"])

    def _streams_kill(self, stack: Stack) -> tuple[str, list]:
        return self._kill_child(stack, KILLED_CHILD["streams_kill"])

    def _learner_kill(self, stack: Stack) -> tuple[str, list]:
        return self._kill_child(stack, KILLED_CHILD["learner_kill"])

    def _engine_kill(self, stack: Stack) -> tuple[str, list]:
        # The whole engine: its supervisor and vLLM's processes (the server runs in its own session).
        engine = next(e for e in stack.engines if e.pool == "current")
        tree = [engine.process.pid, *(p.pid for p in psutil.Process(engine.process.pid).children(recursive=True))]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        engine.process.wait()
        self._killed_engine = engine.engine_id
        return f"engine {engine.engine_id} killed ({len(tree)} processes)", []

    def _restart(self, script: str) -> tuple[str, list]:
        started = time.monotonic()
        for action in ("stop", "start"):
            done = subprocess.run([str(REPO_ROOT / "infra" / script), action], cwd=REPO_ROOT,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RunFailed(f"infra/{script} {action} failed: {done.stderr[-2000:]}")
        return f"down and up again in {time.monotonic() - started:.0f} s", []

    def _kafka_restart(self, stack: Stack) -> tuple[str, list]:
        return self._restart("kafka.sh")

    def _minio_restart(self, stack: Stack) -> tuple[str, list]:
        # Injected when a new version has just been announced: the learner's next publish is
        # already on its way, the restart catches it (or the checkpoint) in flight.
        return self._restart("minio.sh")

    def _poison_events(self, stack: Stack) -> tuple[str, list]:
        producer = Producer(self.cfg.kafka.as_confluent())
        produced: list[tuple[str, int, int]] = []

        def delivered(error: Any, msg: Any) -> None:
            if error is None:
                produced.append((msg.topic(), msg.partition(), msg.offset()))

        for topic in POISON_TOPICS:
            # Keyed by the run: the run's consumers read it (and `replay verify` attributes its dead letter).
            producer.produce(topic, key=self.run.encode(), value=POISON_VALUE, on_delivery=delivered)
        producer.flush(30)
        if len(produced) != len(POISON_TOPICS):
            raise RunFailed(f"only {len(produced)} of {len(POISON_TOPICS)} poison events were delivered")
        return f"one on each of {', '.join(POISON_TOPICS)}", produced

    def _poll_dlq(self, since_ms: int) -> None:
        from pipeline.analysis.replay import Bound, read_topic  # noqa: PLC0415 (only while a poison fault is open)

        self._last_dlq_poll = time.monotonic()
        letters = [r.value for r in read_topic(self.cfg.kafka, topics.DLQ, start=Bound(timestamp_ms=since_ms - 5000))]
        self._dead_letters |= dead_letter_positions(letters)


def run_bench(cfg: RollstreamConfig, run: str, faults: list[str], console: Console) -> dict[str, Any]:
    """The run with its faults, then verify; returns the figures (fault_table) with the run's summary."""
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415
    from pipeline.analysis.replay_verify import verify

    schedule = FaultSchedule(faults, start_version=1, recover_versions=1)
    # Enough learner steps for every fault to go in and be recovered from, with one to spare.
    cfg = cfg.replaced(max_steps=schedule.versions_needed())

    say = timestamped(console)

    injector = Injector(cfg, run, schedule, say)
    say(f"run {run}: {len(faults)} faults ({', '.join(faults)}), {cfg.max_steps} learner steps")
    summary = run_up(cfg, run, console=console, live=False, on_tick=injector.tick, done=lambda: schedule.done,
                     final_eval_timeout_s=RECOVERY_AFTER_LAST_STEP_S)
    if summary["outcome"] != "finished":
        raise RunFailed(f"the run ended {summary['outcome']}")
    say("replaying the run's topics for verify")
    start = Bound.parse(summary["started_at"])
    records = read_run(cfg.kafka, run, start=start)
    report = verify(records, run=run).as_dict()
    figures = fault_table(schedule.records, redone(records, schedule.records), report, summary["restarts"])
    return {"run": run, "duration_s": summary["duration_s"], "learner_steps": cfg.max_steps,
            "restarts": summary["restarts"], **figures}


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench faults — run {result['run']} ({result['duration_s']:.0f} s, "
                        f"{result['learner_steps']} learner steps)")
    for col in ("fault", "at version", "recovered in", "work redone", "restarted", "losses"):
        table.add_column(col, justify="left" if col in ("fault", "work redone", "restarted") else "right")
    for row in result["faults"]:
        work = ", ".join(f"{n} {topic}" for topic, n in row["redone"].items() if n) or "none"
        if row["poison_in_dlq"]:
            work = f"{row['poison_in_dlq']} in dlq"
        table.add_row(row["fault"], str(row["injected_at_version"]),
                      f"{row['recovery_s']:.0f} s" if row["recovered"] else "[red]not recovered[/red]",
                      work, ", ".join(f"{n} x{k}" if k > 1 else n for n, k in row["restarted"].items()) or "—",
                      str(row["losses"]))
    v = result["verify"]
    table.add_row("replay verify (whole run)", "", "", "not checked: " + (", ".join(
        f"{k} {n}" for k, n in v["not_checked"].items()) or "none"), "", str(sum(v["mismatches"].values())))
    console.print(table)
    for row in result["faults"]:
        for finding in row["findings"]:
            console.print(f"[red]finding:[/red] {finding}")
    colour = "green" if result["ok"] else "red"
    console.print(f"[{colour}]losses: {result['losses']}, findings: {result['findings']}[/{colour}]"
                  + (f" (verify: {v['mismatches']})" if v["mismatches"] else ""))


def bench_faults(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="Run configuration (default: a small CPU run "
                                "on a random policy)."),
    faults: str = typer.Option(",".join(FAULTS), "--faults", help="Comma-separated faults, in injection order: "
                               + ", ".join(FAULTS) + "."),
    scaled_down: bool = typer.Option(False, "--scaled-down", help="Only " + ", ".join(SCALED_DOWN)
                                     + " (what `make test` runs)."),
    run: str = typer.Option("", "--run", help="Run id (default: run-<date>-<time>)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (top-level ratio: losses plus "
                                 "findings; ok)."),
) -> None:
    """Inject faults one at a time into a training run and check that nothing is lost: per fault the
    time to recover, the work redone, the losses and the findings (a process restarted during a
    fault it should ride through); exit 1 when any.

    Example: rollstream bench faults --scaled-down --json
    """
    chosen = list(SCALED_DOWN) if scaled_down else [f.strip() for f in faults.split(",") if f.strip()]
    try:
        cfg = load_config(config)
        FaultSchedule(chosen)
    except (ValueError, OSError) as error:
        typer.echo(f"rollstream bench faults: {error}", err=True)
        raise typer.Exit(code=2) from None
    ensure_random_policy(cfg.policy_dir())
    report_run("bench faults", lambda console: run_bench(cfg, run or default_run_id(), chosen, console), as_json,
               print_table)


def report_run(command: str, bench: Callable[[Console], dict[str, Any]], as_json: bool,
               table: Callable[[dict[str, Any], Console], None]) -> None:
    """Runs a fault benchmark and reports it: one JSON object on stdout, or its table on stderr; exit 1
    when the run failed or its result is not `ok`."""
    console = Console(stderr=True)
    try:
        result = bench(console)
    except RunFailed as error:
        console.print(f"[red]rollstream {command}: the run failed:[/red] {error}")
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(result, default=str))
    else:
        table(result, console)
    if not result["ok"]:
        raise typer.Exit(code=1)
