"""`rollstream up`: one training run on this machine, from the policy to the report.

Starts, in order: the policy (made by `model init` + `model sft` when the configured checkpoint
does not exist), the engines of both pools, the Faust worker, the env workers, the learner and
the dispatcher — each a `rollstream` subprocess in its own session, with its log in
`runs/<run>/logs/`. While they run, a follower reads the run's events from Kafka and shows the
live picture (pipeline/run/live_view.py) on stderr. The run ends when the learner has taken
`max_steps` steps and the validation round it triggers has come back (the "after" of the report);
then everything is stopped in reverse order and the report is built from the topics alone. Ctrl-C
or SIGTERM ends it the same way at any point, leaving no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from confluent_kafka import Consumer, KafkaError, TopicPartition
from rich.console import Console
from rich.live import Live

from pipeline.run.config import REPO_ROOT, RollstreamConfig, write_config, write_private
from pipeline.engine.launch import EngineProcess, free_port, launch_engine, stop_process_group
from pipeline.run.live_view import RunView, render
from pipeline.run.plan import (Child, dispatcher_child, engine_args, env_worker_children, final_validation_round,
                              learner_child, rollstream, streams_app_id, streams_child)
from schemas import topics
from schemas.codec import UndecodableEvent, codec
from schemas.settings import KafkaSettings
from streams.routing import stale_schedule
from streams.worker import start_at_end

FOLLOWED = (topics.TASKS_REQUESTED, topics.TRAJECTORIES, topics.STEPS, topics.WEIGHTS, topics.METRICS, topics.ENGINES)


class RunFailed(RuntimeError):
    """A process of the run ended on its own, or the run could not start."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop the run cleanly."""


@dataclass
class RunningChild:
    """A started process of the run."""

    child: Child
    process: subprocess.Popen
    log_path: Path
    log: IO[bytes]

    @classmethod
    def start(cls, child: Child, log_dir: Path) -> RunningChild:
        for path, content in child.files.items():
            write_private(Path(path), content)
        log_path = log_dir / f"{child.name}.log"
        log = open(log_path, "ab")
        # Its own session: Ctrl-C reaches only `up`, which stops every child in order.
        process = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   start_new_session=True)
        return cls(child, process, log_path, log)

    def log_tail(self, chars: int = 2500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to its process group, SIGKILL after timeout_s; its exit status."""
        code = stop_process_group(self.process, timeout_s)
        self.log.close()
        return code


class RunFollower(threading.Thread):
    """Reads the run's events from `since_ms` on, into a RunView (guarded by `lock`)."""

    def __init__(self, kafka: KafkaSettings, view: RunView, since_ms: int) -> None:
        super().__init__(name="run-follower", daemon=True)
        self.view, self.lock, self._halt = view, threading.Lock(), threading.Event()
        self.undecodable = 0
        self._consumer = Consumer(kafka.as_confluent(**{"group.id": f"rollstream-up-view.{view.run}",
                                                        "enable.auto.commit": False}))
        wanted = []
        for name in FOLLOWED:
            meta = self._consumer.list_topics(name, timeout=10).topics[name]
            wanted += [TopicPartition(name, p, since_ms) for p in meta.partitions]
        found = self._consumer.offsets_for_times(wanted, timeout=10)
        # A partition with nothing newer than since_ms answers -1: start at its end.
        self._consumer.assign([TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else -1)
                               for tp in found])

    def run(self) -> None:
        while not self._halt.is_set():
            for msg in self._consumer.consume(500, timeout=0.5):
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        self.undecodable += 1
                    continue
                try:
                    event = codec().decode(msg.value(), topics.EVENT_OF_TOPIC[msg.topic()])
                except UndecodableEvent:
                    self.undecodable += 1  # the consumers of the run send it to `dlq`; the view only counts it
                    continue
                with self.lock:
                    self.view.apply(msg.topic(), event, int(time.time() * 1000))
        self._consumer.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(seconds))


def timestamped(console: Console) -> Callable[[str], None]:
    """A progress line printer: each line prefixed with the time of day, dimmed."""
    def say(line: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {line}", soft_wrap=True)
    return say


def default_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


def ensure_policy(cfg: RollstreamConfig, log_dir: Path, say: Callable[[str], None]) -> Path:
    """The configured checkpoint; made as the default policy (init, then SFT) when it does not exist."""
    path = cfg.policy_dir()
    if (path / "config.json").is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise RunFailed(f"{path} is neither empty nor a checkpoint (no config.json): move it or set policy.path")
    base = path.with_name(path.name + ".init")
    say(f"no policy at {path}: making the default policy (model init + model sft; several minutes, once)")
    # No evaluation inside `model sft`: the run's validation round 0 measures the same policy.
    # SFT demonstrates the run's own tasks (its `envs`: e.g. the calc difficulty), read from a copy of the run's config.
    config = log_dir.parent / "settings" / "policy-config.json"
    write_config(cfg, config)
    steps = [rollstream("model", "init", "--out", str(base), "--force"),
             rollstream("model", "sft", "--model", str(base), "--out", str(path), "--force", "--eval-episodes", "0",
                        "--config", str(config))]
    for argv in steps:
        # Progress bars of these commands go straight to our stderr: nothing else is on screen yet.
        with open(log_dir / "policy.log", "ab") as log:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, start_new_session=True)
            try:
                code = proc.wait()
            except BaseException:  # Ctrl-C or SIGTERM while the policy is made: it stops too
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                raise
        if code != 0:
            raise RunFailed(f"making the default policy failed ({' '.join(argv[2:5])}): see {log_dir / 'policy.log'}")
    return path


def start_engines(cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path,
                  pools: dict[str, int], say: Callable[[str], None], into: list[EngineProcess]) -> None:
    """Launches the engines into `into` (first, so that whoever stops the run stops them even when
    it is interrupted while they load), then waits until each one serves."""
    for pool, count in pools.items():
        for i in range(count):
            into.append(launch_engine(pool=pool, model_dir=model_dir, run=run, work_dir=run_dir / "engines",
                                      engine_id=f"{run}.{pool}-{i}", extra_args=engine_args(cfg), cwd=REPO_ROOT,
                                      bind_host=cfg.engines.bind_host, advertise_host=cfg.engines.advertise_host,
                                      nice=cfg.engines.nice))
    for e in into:
        try:
            seconds = e.wait_until_serving(cfg.engines.start_timeout_s)
        except RuntimeError as error:
            raise RunFailed(str(error)) from None
        say(f"engine {e.engine_id} ({e.pool}) serving at {e.url} after {seconds:.0f} s")


def raise_interrupted(*_: object) -> None:
    # The first signal starts the shutdown; from then on they are ignored (shut_down restores the old
    # handlers), else a second one, e.g. Ctrl-C pressed twice or `timeout` forwarding its own, raised
    # again in the shutdown's first lines and the run ended in a traceback.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted


def catch_interrupts() -> dict[int, Any]:
    """From here on Ctrl-C and SIGTERM raise Interrupted; returns the handlers they replace."""
    return {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}


def shut_down(stack: Stack, follower: RunFollower | None, previous: dict[int, Any],
              say: Callable[[str], None]) -> dict[str, int | None]:
    """Stops the run's processes and its follower, then puts the previous signal handlers back.
    Meanwhile the signals are ignored: a second Ctrl-C, or a supervisor repeating SIGTERM, must not
    cut the shutdown short and leave engines running."""
    for s in previous:
        signal.signal(s, signal.SIG_IGN)
    codes = stack.stop(say)
    if follower is not None:
        follower.stop()
    for s, handler in previous.items():
        signal.signal(s, handler)
    return codes


class Stack:
    """The processes of one run (engines apart), stopped in the reverse of their start order."""

    def __init__(self, log_dir: Path, max_restarts: int = 0) -> None:
        self.log_dir, self.max_restarts = log_dir, max_restarts
        self.children: list[RunningChild] = []
        self.engines: list[EngineProcess] = []
        self.restarts: dict[str, int] = {}

    def start(self, child: Child) -> RunningChild:
        running = RunningChild.start(child, self.log_dir)
        self.children.append(running)
        return running

    def supervise(self, say: Callable[[str], None], finished: Iterable[str] = ()) -> None:
        """Restarts a child that ended on its own (its restart command: the learner resumes from its
        checkpoint, the others from their committed offsets), at most max_restarts times each;
        beyond that raises RunFailed. Children named in `finished` that exited 0 are done, not dead."""
        done = set(finished)
        for i, c in enumerate(self.children):
            code = c.process.poll()
            if code is None or (c.child.name in done and code == 0):
                continue
            used = self.restarts.get(c.child.name, 0)
            if used >= self.max_restarts:
                raise RunFailed(f"{c.child.name} exited with {code}"
                                f"{f' after {used} restarts' if used else ''}:\n{c.log_tail()}")
            c.log.close()
            self.restarts[c.child.name] = used + 1
            say(f"{c.child.name} exited with {code}: restarting it ({used + 1} of {self.max_restarts})")
            self.children[i] = RunningChild.start(c.child.restarted(), self.log_dir)

    def failed(self) -> RunningChild | None:
        """The first child that has exited."""
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, say: Callable[[str], None]) -> dict[str, int | None]:
        codes = {}
        for c in reversed(self.children):
            # env workers drain their in-flight rollouts; the rest stop within seconds
            codes[c.child.name] = c.stop(timeout_s=150 if c.child.name.startswith("env-worker") else 60)
        for e in self.engines:
            e.stop()
            codes[e.engine_id] = e.process.returncode
        say("stopped: " + ", ".join(f"{n} ({'ok' if rc in (0, -15) else rc})" for n, rc in codes.items()))
        return codes


Tick = Callable[["Stack", dict[str, Any]], None]
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
        stack.start(streams_child(cfg, run, run_dir, free_port()))
        for child in env_worker_children(cfg, run, run_dir, model_dir, urls, cfg.envs):
            stack.start(child)
        # Port 0: the learner picks free ports as each weight-sync group forms. A port picked here stayed
        # unbound for a minute and its neighbour (the stale pool's) was never checked; one was taken
        # (make run stalled: the stale engine sat in a join that could not complete).
        stack.start(learner_child(cfg, run, run_dir, model_dir, urls, 0))
        stack.start(dispatcher_child(cfg, run, run_dir))
        say(f"started: {', '.join(c.child.name for c in stack.children)}; training for {cfg.max_steps} steps")
        restart = EngineRestarter(cfg, run, run_dir, model_dir, say)
        outcome = _watch(cfg, run, stack, follower, final_round, console, live, final_eval_timeout_s, say,
                         restart, on_tick, done)
    except Interrupted:
        outcome = "interrupted"
        say("interrupted: stopping every process of the run")
    finally:
        codes = shut_down(stack, follower, previous, say)
    with follower.lock if follower else _nullcontext():
        snapshot = follower.view.snapshot(int(time.time() * 1000)) if follower else {}
    return {"run": run, "outcome": outcome, "started_at": _iso(started), "duration_s": round(time.time() - started, 1),
            "run_dir": str(run_dir), "restarts": stack.restarts,
            "exit_codes": codes, "final_validation_round": final_round, "progress": snapshot}


def stop_listener(port: int) -> None:
    """Kills the process group of whatever still listens on `port` on this machine: a killed engine
    supervisor leaves its vLLM server running (the server has its own session, so that the
    supervisor can stop all of vLLM's processes), holding the port the engine restarts on."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            try:
                os.killpg(os.getpgid(conn.pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")):
        time.sleep(0.2)


class EngineRestarter:
    """Starts an engine that died again, on the version its pool should hold: the learner's latest
    for the current pool, the last multiple of stale_step for the stale one (fetched from the object
    store, as `rollstream eval` does). Later versions reach it through `weights` as usual. At most
    max_restarts times per engine; meanwhile the others serve (env workers skip an engine whose
    heartbeat went stale)."""

    def __init__(self, cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path,
                 say: Callable[[str], None]) -> None:
        self.cfg, self.run, self.run_dir, self.model_dir, self.say = cfg, run, run_dir, model_dir, say

    def version_for(self, pool: str, learner_version: int) -> int:
        return learner_version if pool == "current" else stale_schedule(learner_version, self.cfg.streams.stale_step)

    def dead_engines(self, stack: Stack, learner_version: int) -> None:
        for i, e in enumerate(stack.engines):
            code = e.process.poll()
            if code is None:
                continue
            used = stack.restarts.get(e.engine_id, 0)
            if used >= self.cfg.max_restarts:
                raise RunFailed(f"engine {e.engine_id} exited with {code}"
                                f"{f' after {used} restarts' if used else ''}:\n{e.log_tail()}")
            stack.restarts[e.engine_id] = used + 1
            version = self.version_for(e.pool, learner_version)
            self.say(f"engine {e.engine_id} exited with {code}: restarting it on version {version} "
                     f"({used + 1} of {self.cfg.max_restarts})")
            stack.engines[i] = self._start(e, version)

    def _start(self, dead: EngineProcess, version: int) -> EngineProcess:
        from pipeline.cli.eval import VersionUnavailable, materialize_version  # object store clients: only here

        model_dir, extra = self.model_dir, ()
        if version > 0:
            try:
                model_dir = materialize_version(self.cfg, self.run, version, self.model_dir,
                                                self.run_dir / "engines" / f"{dead.engine_id}.restart")
                extra = ("--initial-version", str(version))
            except VersionUnavailable as error:
                raise RunFailed(f"engine {dead.engine_id} cannot restart on version {version}: {error}") from None
        # On its old port: the learner's broadcast targets and the env workers' routes stay valid.
        port = int(dead.url.rsplit(":", 1)[1])
        stop_listener(port)
        engine = launch_engine(pool=dead.pool, model_dir=model_dir, run=self.run, work_dir=self.run_dir / "engines",
                               port=port, engine_id=dead.engine_id,
                               extra_args=engine_args(self.cfg) + extra, cwd=REPO_ROOT,
                               bind_host=self.cfg.engines.bind_host, advertise_host=self.cfg.engines.advertise_host,
                               nice=self.cfg.engines.nice)
        return engine


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def _watch(cfg: RollstreamConfig, run: str, stack: Stack, follower: RunFollower, final_round: int | None,
           console: Console, live: bool, final_eval_timeout_s: float, say: Callable[[str], None],
           restart: EngineRestarter, on_tick: Tick | None, done: Callable[[], bool] | None) -> str:
    """Shows progress until the learner is done and the final validation is back; raises RunFailed
    when a process dies on its own."""
    learner_done_at: float | None = None
    title = f"rollstream up — run {run}"
    with Live(console=console, refresh_per_second=1, transient=False) if live else _nullcontext() as screen:
        while True:
            time.sleep(1.0)
            with follower.lock:
                snap = follower.view.snapshot(int(time.time() * 1000))
                final_done = final_round is None or follower.view.validation_complete(final_round)
            if screen is not None:
                screen.update(render(snap, title))
            learner = next(c for c in stack.children if c.child.name == "learner")
            if learner_done_at is None and learner.process.poll() == 0:
                learner_done_at = time.monotonic()
                say(f"learner finished {cfg.max_steps} steps; waiting for validation round {final_round}")
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
