"""The engines of a run: launched and waited for at its start, started again when one dies."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from pipeline.engine.cpus import AUTO, engine_cpu_sets
from pipeline.engine.launch import EngineProcess, free_port, launch_engine
from pipeline.run.config import REPO_ROOT, RollstreamConfig, write_config
from pipeline.run.plan import engine_args, run_config_path
from pipeline.run.supervision import RunFailed, Stack
from streams.routing import stale_schedule


def launch_run_engine(cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path, pool: str, engine_id: str,
                      port: int | None = None, extra_args: tuple[str, ...] = (),
                      metrics_port: int | None = None, cpus: str = AUTO) -> EngineProcess:
    """One engine of the run, launched as the run's configuration says (not yet serving); its supervisor
    serves Prometheus metrics on `metrics_port` (default: a free port), its vLLM worker binds to `cpus`. It reads
    the run's whole configuration from the run's settings (plan.run_config_path), not from the environment alone."""
    config = run_config_path(run_dir)
    write_config(cfg, config)
    return launch_engine(pool=pool, model_dir=model_dir, run=run, work_dir=run_dir / "engines", port=port,
                         engine_id=engine_id, extra_args=("--config", str(config), *engine_args(cfg), *extra_args),
                         cwd=REPO_ROOT,
                         bind_host=cfg.engines.bind_host, advertise_host=cfg.engines.advertise_host,
                         nice=cfg.engines.nice, metrics_port=metrics_port or free_port(), cpus=cpus)


def start_engines(cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path,
                  pools: dict[str, int], say: Callable[[str], None], into: list[EngineProcess]) -> None:
    """Launches the engines into `into` (first, so that whoever stops the run stops them even when
    it is interrupted while they load), then waits until each one serves. With `engines.cpu_binding` spread,
    each gets cores of its own (all of them run on this host)."""
    names = [(pool, f"{run}.{pool}-{i}") for pool, count in pools.items() for i in range(count)]
    bindings = (engine_cpu_sets(sorted(os.sched_getaffinity(0)), len(names)) if cfg.engines.cpu_binding == "spread"
                else [AUTO] * len(names))
    for (pool, engine_id), cpus in zip(names, bindings):
        into.append(launch_run_engine(cfg, run, run_dir, model_dir, pool, engine_id, cpus=cpus))
    for e in into:
        try:
            seconds = e.wait_until_serving(cfg.engines.start_timeout_s)
        except RuntimeError as error:
            raise RunFailed(str(error)) from None
        say(f"engine {e.engine_id} ({e.pool}) serving at {e.url} after {seconds:.0f} s")


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
    store, as `rollstream eval` does). Later versions reach it through `weights` as usual. Within the
    run's restart budget (the stack's, shared with its other processes); meanwhile the others serve
    (env workers skip an engine whose heartbeat went stale)."""

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
            n = stack.budget.take(e.engine_id, code, e.log_tail, label=f"engine {e.engine_id}")
            version = self.version_for(e.pool, learner_version)
            self.say(f"engine {e.engine_id} exited with {code}: restarting it on version {version} "
                     f"({n} of {stack.budget.limit})")
            stack.engines[i] = self._start(e, version)

    def _start(self, dead: EngineProcess, version: int) -> EngineProcess:
        try:
            model_dir, extra = rejoin_model(self.cfg, self.run, version, self.model_dir,
                                            self.run_dir / "engines" / f"{dead.engine_id}.restart")
        except RunFailed as error:
            raise RunFailed(f"engine {dead.engine_id} cannot restart: {error}") from None
        # On its old ports: the learner's broadcast targets and the env workers' routes stay valid, and so
        # does the metrics URL `up` listed.
        port = int(dead.url.rsplit(":", 1)[1])
        stop_listener(port)
        return launch_run_engine(self.cfg, self.run, self.run_dir, model_dir, dead.pool, dead.engine_id, port, extra,
                                 dead.metrics_port, dead.cpus)


def rejoin_model(cfg: RollstreamConfig, run: str, version: int, model_dir: Path, out: Path) -> tuple[Path, tuple[str, ...]]:
    """(checkpoint, extra engine options) for an engine that (re)starts when its pool holds `version`: the
    run's policy at version 0, else that version fetched from the object store (as `rollstream eval`
    does). Later versions reach it through `weights` as usual."""
    from pipeline.policy.loading import (  # object store clients: only here
        VersionUnavailable,
        materialize_version,
    )
    if version == 0:
        return model_dir, ()
    try:
        served = materialize_version(cfg, run, version, model_dir, out)
    except VersionUnavailable as error:
        raise RunFailed(f"version {version} is unavailable: {error}") from None
    # Served under the run's model id, not the restart directory's path: the env workers send the id they
    # read from the engines at start, and any other answers 404.
    return served, ("--initial-version", str(version), "--served-name", str(model_dir))


def pool_version_now(cfg: RollstreamConfig, run: str, pool: str) -> int:
    """The version an engine of `pool` joining the run now should hold, from the learner's latest staged
    version in the object store (0 before the first): for an engine started on its own (`rollstream process
    engine`: a container restarted by its engine's restart policy)."""
    from learner.publish import staged_versions  # object store clients: only here
    from schemas import objectstore

    versions = staged_versions(objectstore.client(cfg.object_store), run)
    latest = versions[-1] if versions else 0
    return latest if pool == "current" else stale_schedule(latest, cfg.streams.stale_step)
