"""`rollstream bench chaos`: a training run (`bench faults`' machinery) under a seeded random schedule
of faults for a fixed time, one or two at once, several at the moment they hurt most; then `replay
verify` over the run and a search for anything left behind.

The schedule, the moments and the figures are pure logic (pipeline/bench/chaos_logic.py); this module
injects and lifts: the kills, restarts and poison events of `bench faults` (its Injector), an engine
stopped with SIGSTOP and resumed, an env worker stopped two seconds in three, and the broker's log
directory filled to within `--headroom-mb` of full with one preallocated file (the filesystem holding
it fills for everything on it: on a shared disk, the object store too).

The moments come from outside the processes, as an operator would see them: a new `weights` version
(the run's follower), a version's manifest in the object store that `weights` has not announced (the
learner has trained the step and is checkpointing it), the `batches` topic's end moving (the stream
processor has just cut a batch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import typer
from confluent_kafka import Consumer, KafkaException, TopicPartition
from rich.console import Console
from rich.table import Table

from pipeline.bench.chaos_logic import (
    BATCH_CUT,
    CHECKPOINT,
    FAULTS,
    SCALED_DOWN,
    WEIGHT_UPDATE,
    ChaosSchedule,
    ChaosSettings,
    Episode,
    Injected,
    ballast_bytes,
    chaos_table,
    drain_versions,
    redone_in,
    restarts_in,
    slow_phase,
    trained_twice,
)
from pipeline.bench.faults import Injector, report_run
from pipeline.bench.faults_logic import dead_letter_positions, repeated_ids
from pipeline.dispatch.logic import in_flight_bound
from pipeline.policy.random_policy import ensure_random_policy
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from pipeline.run.follower import QUIET_CLIENT_LOG
from pipeline.run.up import RunFailed, Stack, default_run_id, run_up, timestamped
from schemas import objectstore, topics

DEFAULT_CONFIG = REPO_ROOT / "configs" / "faults.yaml"
CHAOS_RESTARTS = 100
"""The run's restart budget: an hour of chaos kills each process several times on purpose."""
CHECKPOINT_POLL_S = 0.1
START_LIMIT_S = 900.0
"""How long the run may take to train its first version (engines start, the first batch fills)."""
KAFKA_DIR = Path(os.environ.get("ROLLSTREAM_RUN", REPO_ROOT / ".run")) / "kafka"
BALLAST_NAME = "chaos-ballast"
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


class NotInjected(Exception):
    """The machine cannot inject this fault (the message says why); the run goes on without it."""


class ChaosInjector(Injector):
    """Injects the schedule's episodes from `run_up`'s tick, lifts the lasting faults, watches recovery
    and stops the learner (SIGTERM: it checkpoints and exits) when the schedule is done."""

    def __init__(self, cfg: RollstreamConfig, run: str, schedule: ChaosSchedule, say: Any,
                 headroom_mb: int) -> None:
        super().__init__(cfg, run, schedule=None, say=say)  # type: ignore[arg-type]
        self.chaos = schedule
        self.headroom = headroom_mb * 2**20
        self.created = time.monotonic()
        self.started: float | None = None  # the chaos clock starts at the learner's first trained version
        self.started_ms = 0
        self.last_version = -1
        self.last_batches_end: int | None = None
        self.lasting: list[tuple[Injected, dict[str, Any]]] = []  # open lasting faults and their state
        self.stopped_learner = False
        self._served_ids: dict[str, str | None] = {}  # engine id -> the model id it served before its fault
        self._mc = objectstore.client(cfg.object_store)
        self._watermarks = Consumer(cfg.kafka.as_confluent(**{"group.id": f"{run}-chaos-watch",
                                                               "enable.auto.commit": False,
                                                               "logger": QUIET_CLIENT_LOG}))

    def now_s(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    # -- the tick -------------------------------------------------------------------------------

    def tick(self, stack: Stack, snap: dict[str, Any]) -> None:
        version = snap["learner_version"]
        if self.started is None:
            # Engines starting and the first batch filling are not chaos time.
            if version < self.chaos.s.start_version:
                if time.monotonic() - self.created > START_LIMIT_S:
                    raise RunFailed(f"the learner published no version {self.chaos.s.start_version} within "
                                    f"{START_LIMIT_S:.0f} s")
                return
            self.started, self.started_ms = time.monotonic(), int(time.time() * 1000)
            self.say(f"learner at version {version}: {self.chaos.s.minutes:g} minutes of chaos begin")
        now = self.now_s()
        moments = self._moments(version)
        self._lift(stack, now)
        episode = self.chaos.open
        if episode is not None:
            self._observe(stack, episode, now, version)
        else:
            due = self.chaos.due(now, version, moments)
            if not due and self.chaos.planned and FAULTS[self.chaos.planned[0]].moment == CHECKPOINT:
                moments |= self._wait_for_checkpoint(version)
                due = self.chaos.due(self.now_s(), version, moments)
            if due:
                self._inject(stack, due, version, moments)
        if self.chaos.done(self.now_s()) and not self.stopped_learner:
            self._stop_learner(stack)

    def _moments(self, version: int) -> set[str]:
        seen = set()
        if version > self.last_version >= 0:
            seen.add(WEIGHT_UPDATE)
        self.last_version = version
        end = self._batches_end()
        if end is not None:
            if self.last_batches_end is not None and end > self.last_batches_end:
                seen.add(BATCH_CUT)
            self.last_batches_end = end
        return seen

    def _batches_end(self) -> int | None:
        """The `batches` topic's end offset summed over its partitions; None while the broker is away."""
        try:
            parts = self._watermarks.list_topics(topics.BATCHES, timeout=2).topics[topics.BATCHES].partitions
            return sum(self._watermarks.get_watermark_offsets(TopicPartition(topics.BATCHES, p), timeout=2,
                                                              cached=False)[1] for p in parts)
        except (KafkaException, KeyError):
            return None

    def _staged_unannounced(self, version: int) -> bool:
        """The learner has staged its next version but not written that step's checkpoint yet (it
        announces only after the checkpoint). Both are read from the object store: the run's
        follower may not have seen the newest announcement yet."""
        from learner.checkpoint import META_FILE, step_prefix  # noqa: PLC0415 (the learner's key layout)
        from learner.publish import manifest_uri  # noqa: PLC0415

        bucket, key = objectstore.parse_uri(manifest_uri(self.run, version + 1))
        if not self._exists(bucket, key):
            return False
        # One step per version: the checkpoint of the step that made version v is at step v; its meta
        # file is written after its state, so without it the checkpoint is not complete.
        return not self._exists(topics.CHECKPOINTS_BUCKET, step_prefix(self.run, version + 1) + META_FILE)

    def _exists(self, bucket: str, key: str) -> bool:
        try:
            self._mc.stat_object(bucket, key)
            return True
        except Exception:  # noqa: BLE001 (absent, or the object store is away)
            return False

    def _wait_for_checkpoint(self, version: int) -> set[str]:
        """Polls, for up to most of a tick, for the learner's next version to be staged unannounced."""
        deadline = time.monotonic() + 0.9
        while time.monotonic() < deadline:
            if self._staged_unannounced(version):
                return {CHECKPOINT}
            time.sleep(CHECKPOINT_POLL_S)
        return set()

    def _inject(self, stack: Stack, names: list[str], version: int, moments: set[str]) -> None:
        now = self.now_s()
        restarts = dict(stack.restarts)
        made = []
        for name in names:
            self.say(f"[yellow]injecting[/yellow] {name} at learner version {version}"
                     + (f" ({', '.join(sorted(moments))})" if moments else "") + f": {FAULTS[name].what}")
            fault = Injected(name, len(self.chaos.episodes), now, version, moment="")
            try:
                fault.detail, fault.poison = getattr(self, f"_chaos_{name}")(stack, fault)
            except NotInjected as why:
                fault.injected, fault.detail = False, f"not injected: {why}"
                self.say(f"[red]{name} not injected:[/red] {why}")
            made.append(fault)
        self.chaos.injected(now, version, moments, made, restarts)

    def _observe(self, stack: Stack, episode: Episode, now: float, version: int) -> None:
        poisoned = [f for f in episode.faults if f.poison and f.recovered_at_s is None]
        if poisoned and time.monotonic() - self._last_dlq_poll > 3.0:
            self._poll_dlq(self.started_ms + int(min(f.injected_at_s for f in poisoned) * 1000))
        back = {f.name: self._is_back(stack, episode, f) for f in episode.faults if f.recovered_at_s is None}
        for f in self.chaos.observe(now, version, back, self._dead_letters):
            self.say(f"[green]recovered[/green] from {f.name} in {f.recovery_s:.0f} s (learner at version {version})")

    def _is_back(self, stack: Stack, episode: Episode, fault: Injected) -> bool:
        if not fault.injected:
            return True
        if fault.name in ("env_worker_kill", "streams_kill", "learner_kill"):
            child = next(c for c in stack.children if c.child.name == fault.killed)
            return child.process.poll() is None and \
                stack.restarts.get(fault.killed, 0) > episode.restarts_before.get(fault.killed, 0)
        if fault.name in ("engine_kill", "engine_hang"):
            engine = next((e for e in stack.engines if e.engine_id == fault.hit), None)
            # Serving again means serving the run's model id: a restarted engine that answers /health
            # under another id refuses every rollout (404).
            if engine is None or engine.process.poll() is not None:
                return False
            now = served_id(engine.url)
            return now is not None and now == (self._served_ids.get(fault.hit) or now)
        return True

    def _stop_learner(self, stack: Stack) -> None:
        learner = next(c for c in stack.children if c.child.name == "learner")
        self.say("chaos over: stopping the learner (it checkpoints and exits)")
        try:
            os.killpg(learner.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.stopped_learner = True

    # -- lasting faults -------------------------------------------------------------------------

    def _lift(self, stack: Stack, now: float) -> None:
        for fault, state in list(self.lasting):
            elapsed = now - fault.injected_at_s
            over = elapsed >= FAULTS[fault.name].hold_s
            if fault.name == "engine_hang" and over:
                self._signal_tree(state["pids"], signal.SIGCONT)
            elif fault.name == "env_worker_slow":
                child = next(c for c in stack.children if c.child.name == "env-worker-1")
                stopped = not over and slow_phase(elapsed)
                if stopped != state.get("stopped"):
                    try:
                        os.killpg(child.process.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                    state["stopped"] = stopped
            elif fault.name == "kafka_disk_full" and over:
                state["path"].unlink(missing_ok=True)
            if over:
                fault.lifted_at_s = now
                self.lasting.remove((fault, state))
                self.say(f"lifted {fault.name} after {elapsed:.0f} s")

    def lift_all(self) -> None:
        """Lifts whatever is still held (the bench ends or fails): nothing stays stopped or allocated."""
        for fault, state in self.lasting:
            if "pids" in state:
                self._signal_tree(state["pids"], signal.SIGCONT)
            if "path" in state:
                state["path"].unlink(missing_ok=True)
            if "pgid" in state:
                try:
                    os.killpg(state["pgid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.lasting.clear()
        (KAFKA_DIR / BALLAST_NAME).unlink(missing_ok=True)

    @staticmethod
    def _signal_tree(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # -- the faults -----------------------------------------------------------------------------

    def _chaos_env_worker_kill(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        fault.hit = fault.killed = "env-worker-0"
        return self._kill_child(stack, "env-worker-0")

    def _chaos_streams_kill(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        fault.hit = fault.killed = "streams"
        return self._kill_child(stack, "streams")

    def _chaos_learner_kill(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        fault.hit = fault.killed = "learner"
        return self._kill_child(stack, "learner")

    def _chaos_engine_kill(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        engine = next(e for e in stack.engines if e.pool == "current")
        self._served_ids[engine.engine_id] = served_id(engine.url)
        detail, poison = self._engine_kill(stack)
        fault.hit = fault.killed = self._killed_engine
        return detail, poison

    def _chaos_engine_hang(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        engine = next((e for e in stack.engines if e.pool == "current" and e.process.poll() is None), None)
        if engine is None:
            raise NotInjected("no current-pool engine is running")
        fault.hit = engine.engine_id
        self._served_ids[engine.engine_id] = served_id(engine.url)
        pids = [engine.process.pid, *(p.pid for p in psutil.Process(engine.process.pid).children(recursive=True))]
        self._signal_tree(pids, signal.SIGSTOP)
        self.lasting.append((fault, {"pids": pids}))
        return f"engine {engine.engine_id} stopped ({len(pids)} processes)", []

    def _chaos_env_worker_slow(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        child = next((c for c in stack.children if c.child.name == "env-worker-1"), None)
        if child is None:
            raise NotInjected("the run has no env-worker-1")
        fault.hit = child.child.name
        self.lasting.append((fault, {"pgid": child.process.pid}))
        return f"env-worker-1 (pid {child.process.pid}) stopped 2 s in 3", []

    def _chaos_kafka_disk_full(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        path = KAFKA_DIR / BALLAST_NAME
        fstype = filesystem_type(KAFKA_DIR)
        if fstype in IN_MEMORY_FILESYSTEMS:
            # Preallocating there takes memory, not disk: the OOM killer, not a full disk, would answer.
            raise NotInjected(f"{KAFKA_DIR} is on {fstype}, in memory")
        free = os.statvfs(KAFKA_DIR)
        size = ballast_bytes(free.f_bavail * free.f_frsize, self.headroom)
        if size == 0:
            raise NotInjected(f"less than {self.headroom // 2**20} MB free already")
        try:
            with path.open("wb") as f:
                os.posix_fallocate(f.fileno(), 0, size)
        except OSError as error:
            path.unlink(missing_ok=True)
            raise NotInjected(f"cannot preallocate {size / 2**30:.1f} GiB in {KAFKA_DIR}: {error}") from None
        self.lasting.append((fault, {"path": path}))
        left = os.statvfs(KAFKA_DIR)
        return f"{size / 2**30:.1f} GiB allocated, {left.f_bavail * left.f_frsize / 2**20:.0f} MB left free", []

    def _chaos_kafka_restart(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        return self._restart("kafka.sh")

    def _chaos_minio_restart(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        return self._restart("minio.sh")

    def _chaos_poison_events(self, stack: Stack, fault: Injected) -> tuple[str, list]:
        return self._poison_events(stack)

    def close(self) -> None:
        self.lift_all()
        self._watermarks.close()


def served_id(url: str) -> str | None:
    """The model id an engine serves (None while it does not answer)."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=2)
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` lies on (the longest mount point above it)."""
    resolved = str(path.resolve())
    mounts = [p for p in psutil.disk_partitions(all=True)
              if resolved == p.mountpoint or resolved.startswith(p.mountpoint.rstrip("/") + "/")]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


def left_behind(run: str) -> list[str]:
    """Processes of the run still running, mounts naming it, and the ballast file."""
    found = [line for line in subprocess.run(["pgrep", "-af", run], capture_output=True, text=True).stdout.splitlines()
             if "pgrep" not in line and "bench chaos" not in line]
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if run in line]
    ballast = [str(KAFKA_DIR / BALLAST_NAME)] if (KAFKA_DIR / BALLAST_NAME).exists() else []
    return found + mounts + ballast


def run_bench(cfg: RollstreamConfig, run: str, settings: ChaosSettings, headroom_mb: int,
              console: Console) -> dict[str, Any]:
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415
    from pipeline.analysis.replay_verify import verify  # noqa: PLC0415

    schedule = ChaosSchedule(settings)
    # The learner runs until the schedule is done (then SIGTERM); max_steps only bounds it.
    cfg = cfg.replaced(max_steps=100_000, max_restarts=CHAOS_RESTARTS)
    say = timestamped(console)
    injector = ChaosInjector(cfg, run, schedule, say, headroom_mb)
    say(f"run {run}: {settings.minutes:g} minutes of chaos (seed {settings.seed}) over {', '.join(settings.faults)}")
    try:
        summary = run_up(cfg, run, console=console, live=False, on_tick=injector.tick,
                         done=lambda: injector.stopped_learner, final_eval_timeout_s=settings.recovery_limit_s)
    finally:
        injector.close()
    if summary["outcome"] != "finished":
        raise RunFailed(f"the run ended {summary['outcome']}")
    say("replaying the run's topics for verify")
    records = read_run(cfg.kafka, run, start=Bound.parse(summary["started_at"]))
    report = verify(records, run=run).as_dict()
    episodes = schedule.episodes
    twice = trained_twice([r.value for r in records.get(topics.BATCHES, ())],
                          [r.value for r in records.get(topics.WEIGHTS, ())])
    figures = chaos_table(episodes, redone_in(repeated_ids(records), episodes, injector.started_ms),
                          restarts_in(episodes, summary["restarts"]), report, twice, left_behind(run))
    return {"run": run, "minutes": settings.minutes, "seed": settings.seed, "duration_s": summary["duration_s"],
            "learner_version": summary["progress"].get("learner_version"), "restarts": summary["restarts"],
            **figures}


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench chaos — run {result['run']} ({result['duration_s']:.0f} s, {result['episodes']} "
                        f"episodes, {result['pairs']} of two faults, learner at version {result['learner_version']})")
    for col in ("fault", "count", "at its moment", "recovery p50", "p90", "max", "work redone", "unrecovered"):
        table.add_column(col, justify="left" if col in ("fault", "work redone") else "right")

    def secs(v: float | None) -> str:
        return "—" if v is None else f"{v:.0f} s"

    for name, k in result["per_fault"].items():
        r = k["recovery_s"]
        work = ", ".join(f"{n} {topic}" for topic, n in k["redone"].items() if n) or "none"
        table.add_row(name, str(k["count"]) + (f" (+{k['not_injected']} not injected)" if k["not_injected"] else ""),
                      f"{k['at_moment']}/{k['count']}" if k["moment"] != "any" else "—", secs(r["p50"]),
                      secs(r["p90"]), secs(r["max"]), work, str(k["unrecovered"]))
    console.print(table)
    for row in result["episode_rows"]:
        for finding in row["findings"]:
            console.print(f"[red]finding:[/red] {finding}")
    for thing in result["left_behind"]:
        console.print(f"[red]left behind:[/red] {thing}")
    v = result["verify"]
    colour = "green" if result["ok"] else "red"
    console.print(f"[{colour}]ratio {result['ratio']}: losses {result['losses']}, batches trained twice "
                  f"{result['batches_trained_twice']}, trajectories trained twice {result['trajectories_trained_twice']}"
                  f"; findings {result['findings']}; verify {'clean' if v['ok'] else v['mismatches']}[/{colour}]")


def bench_chaos(
    minutes: float = typer.Option(60.0, "--minutes", help="How long faults are injected (the run then finishes "
                                  "the episode in flight and stops)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fault schedule."),
    faults: str = typer.Option(",".join(FAULTS), "--faults", help="Comma-separated fault kinds to draw from: "
                               + ", ".join(FAULTS) + "."),
    pairs: float = typer.Option(0.3, "--pairs", help="Probability that an episode injects two faults at once."),
    scaled_down: bool = typer.Option(False, "--scaled-down", help="Only " + ", ".join(SCALED_DOWN)
                                     + ", half of the episodes in pairs (what `make test` runs with a few minutes)."),
    headroom_mb: int = typer.Option(512, "--headroom-mb", help="What kafka_disk_full leaves free on the broker's "
                                    "filesystem."),
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="Run configuration (default: bench faults' "
                                "small CPU run on a random policy)."),
    run: str = typer.Option("", "--run", help="Run id (default: run-<date>-<time>)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (top-level ratio: losses plus "
                                 "batches and trajectories trained twice; ok)."),
) -> None:
    """Train under a random schedule of faults, one or two at once, for --minutes; then verify the
    run's topics. Per fault kind: count, recovery times, work redone; for the run: losses, batches
    and trajectories trained twice (their sum is `ratio`, 0 when all is well), findings (a process
    restarted when no fault killed it) and anything left running. Exit 1 unless all are zero.

    Example: rollstream bench chaos --minutes 60 --seed 1 --json
    """
    chosen = tuple(SCALED_DOWN) if scaled_down else tuple(f.strip() for f in faults.split(",") if f.strip())
    try:
        cfg = load_config(config)
        bound = in_flight_bound(cfg.streams.batch_size, cfg.mix.max_in_flight_groups)
        settings = ChaosSettings(minutes=minutes, seed=seed, faults=chosen, pair_probability=0.5 if scaled_down
                                 else pairs, drain_versions=drain_versions(bound, cfg.streams.batch_size))
    except (ValueError, OSError) as error:
        typer.echo(f"rollstream bench chaos: {error}", err=True)
        raise typer.Exit(code=2) from None
    ensure_random_policy(cfg.policy_dir())
    report_run("bench chaos", lambda console: run_bench(cfg, run or default_run_id(), settings, headroom_mb, console),
               as_json, print_table)
