"""`rollstream up`: one training run on this machine, from the policy to the report.

Starts, in order: the policy (made by `model init` + `model sft` when the configured checkpoint
does not exist), the engines of both pools, the Faust worker, the env workers, the learner and
the dispatcher — each a `rollstream` subprocess in its own session, with its log in
`runs/<run>/logs/` and its Prometheus metrics on a port of its own (listed on stderr and in
`runs/<run>/logs/metrics_urls.json`; schemas/prometheus.py). While they run, a follower reads the
run's events from Kafka and shows the live picture (pipeline/run/live_view.py) on stderr. The run
ends when the learner has taken `max_steps` steps and the validation round it triggers has come
back (the "after" of the report); then everything is stopped in reverse order and the report is
built from the topics alone. Ctrl-C or SIGTERM ends it the same way at any point, leaving no
process behind, and so does an alert whose rule's action is stop (streams.alerts; the outcome says
which rule). Every alert of the run is said on stderr as it arrives.

The pieces, one concern each: pipeline/run/policy.py (the policy), supervision.py (the processes
and their restart budget), engines.py (the engines, started and restarted), follower.py (the live
view's reader), interrupts.py (signals and the shutdown).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from pipeline.engine.launch import free_port, free_ports
from pipeline.run.config import RollstreamConfig
from pipeline.run.engines import EngineRestarter, start_engines
from pipeline.run.follower import RunFollower
from pipeline.run.interrupts import Interrupted, catch_interrupts, shut_down
from pipeline.run.live_view import RunView, render
from pipeline.run.plan import (
    dispatcher_child,
    env_worker_children,
    final_validation_round,
    learner_child,
    streams_app_id,
    streams_child,
    with_metrics_port,
    with_run_config,
)
from pipeline.run.policy import ensure_policy
from pipeline.run.supervision import RunFailed, Stack
from schemas.prometheus import metrics_line
from streams.alerts import describe
from streams.worker import start_at_end

# What callers of `rollstream up`'s machinery (the CLI, `rollstream eval`, the benchmarks) import from here.
__all__ = ["STOPPED_BY_ALERT", "Interrupted", "RunFailed", "RunFollower", "Stack", "Tick", "catch_interrupts",
           "default_run_id", "run_up", "shut_down", "start_engines", "summary_json", "timestamped"]


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(seconds))


def timestamped(console: Console) -> Callable[[str], None]:
    """A progress line printer: each line prefixed with the time of day, dimmed."""
    def say(line: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {line}", soft_wrap=True)
    return say


def default_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


STOPPED_BY_ALERT = "stopped by alert"
"""The start of the outcome of a run an alert stopped: `stopped by alert RULE`."""

Tick = Callable[[Stack, dict[str, Any]], None]
"""Called about once a second with the run's processes and its live snapshot (`bench faults` injects
its faults from here)."""


def run_up(cfg: RollstreamConfig, run: str, *, console: Console, live: bool = True,
           final_eval_timeout_s: float = 900.0, on_tick: Tick | None = None,
           done: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Runs one training run to its end (or Ctrl-C); returns its summary. The report is built by the caller.
    `done`, when given, must also be true before the run ends (the learner having finished)."""
    run_dir = cfg.run_dir(run)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))

    say = timestamped(console)

    previous = catch_interrupts()
    started = time.time()
    stack = Stack(log_dir, cfg.max_restarts)
    follower: RunFollower | None = None
    outcome = "finished"
    final_round = final_validation_round(cfg)
    try:
        model_dir = ensure_policy(cfg, log_dir, say)
        say(f"run {run}: policy {model_dir}; logs in {log_dir}")
        start_engines(cfg, run, run_dir, model_dir, {"current": cfg.engines.current, "stale": cfg.engines.stale},
                      say, into=stack.engines)
        urls = {pool: [e.url for e in stack.engines if e.pool == pool] for pool in ("current", "stale")}
        urls = {pool: u for pool, u in urls.items() if u}
        # Before anything is dispatched: the run's Faust app starts at the topics' current end.
        start_at_end(cfg.kafka, streams_app_id(run))
        view = RunView(run)
        follower = RunFollower(cfg.kafka, view, since_ms=int(started * 1000) - 5000)
        follower.start()
        children = [with_run_config(child, cfg, run_dir) for child in (
                    streams_child(cfg, run, run_dir, free_port()),
                    *env_worker_children(cfg, run, run_dir, model_dir, urls, cfg.envs),
                    # Port 0: the learner picks free ports as each weight-sync group forms. A port picked here
                    # stayed unbound for a minute and its neighbour (the stale pool's) was never checked; one
                    # was taken (make run stalled: the stale engine sat in a join that could not complete).
                    learner_child(cfg, run, run_dir, model_dir, urls, 0),
                    dispatcher_child(cfg, run, run_dir))]
        for child, port in zip(children, free_ports(len(children)), strict=True):
            stack.start(with_metrics_port(child, port))
        say(f"started: {', '.join(c.child.name for c in stack.children)}; training for {cfg.max_steps} steps")
        _list_metrics(stack, log_dir, say)
        restart = EngineRestarter(cfg, run, run_dir, model_dir, say)
        outcome = _watch(cfg, run, stack, follower, final_round, console, live, final_eval_timeout_s, say,
                         restart, on_tick, done)
    except Interrupted:
        outcome = "interrupted"
        say("interrupted: stopping every process of the run")
    finally:
        codes = shut_down(stack, follower, previous, say)
    with follower.lock if follower else nullcontext():
        snapshot = follower.view.snapshot(int(time.time() * 1000)) if follower else {}
    return {"run": run, "outcome": outcome, "started_at": _iso(started), "duration_s": round(time.time() - started, 1),
            "run_dir": str(run_dir), "restarts": stack.restarts, "metrics": stack.metrics_urls(),
            "exit_codes": codes, "final_validation_round": final_round, "progress": snapshot}


def _list_metrics(stack: Stack, log_dir: Path, say: Callable[[str], None]) -> None:
    """One line per process saying where its Prometheus metrics are, and the same in the logs folder."""
    urls = stack.metrics_urls()
    for name, url in urls.items():
        say(metrics_line(name, url))
    (log_dir / "metrics_urls.json").write_text(json.dumps(urls, indent=2) + "\n")


def _watch(cfg: RollstreamConfig, run: str, stack: Stack, follower: RunFollower, final_round: int | None,
           console: Console, live: bool, final_eval_timeout_s: float, say: Callable[[str], None],
           restart: EngineRestarter, on_tick: Tick | None, done: Callable[[], bool] | None) -> str:
    """Shows progress until the learner is done and the final validation is back; raises RunFailed
    when a process dies on its own beyond its restart budget."""
    learner_done_at: float | None = None
    title = f"rollstream up — run {run}"
    alerts_said = 0
    with Live(console=console, refresh_per_second=1, transient=False) if live else nullcontext() as screen:
        while True:
            time.sleep(1.0)
            with follower.lock:
                snap = follower.view.snapshot(int(time.time() * 1000))
                final_done = final_round is None or follower.view.validation_complete(final_round)
            if screen is not None:
                screen.update(render(snap, title))
            for alert in snap["alerts"][alerts_said:]:
                say(f"alert {describe(alert)}")
            alerts_said = len(snap["alerts"])
            if snap["stopped_by"] is not None:
                say(f"alert {snap['stopped_by']} stops the run: stopping every process of the run")
                return f"{STOPPED_BY_ALERT} {snap['stopped_by']}"
            learner = next(c for c in stack.children if c.child.name == "learner")
            if learner_done_at is None and learner.process.poll() == 0:
                learner_done_at = time.monotonic()
                say(f"learner finished at version {snap['learner_version']}"
                    + (f"; waiting for validation round {final_round}" if final_round is not None else ""))
            stack.supervise(say, finished=("learner",))
            restart.dead_engines(stack, snap["learner_version"])
            if on_tick is not None:
                on_tick(stack, snap)
            if learner_done_at is not None:
                caller_done = done is None or done()
                if final_done and caller_done:
                    return "finished"
                if time.monotonic() - learner_done_at > final_eval_timeout_s:
                    if not final_done:
                        say(f"final validation round {final_round} incomplete after {final_eval_timeout_s:.0f} s")
                        return "final validation incomplete"
                    say(f"stopping {final_eval_timeout_s:.0f} s after the learner finished")
                    return "finished"


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, default=str)
