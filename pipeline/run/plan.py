"""What `rollstream up` starts, as plain data: the command line of every process of a run.

Pure: builds argument vectors and the settings files they read from the run configuration, so a
test can check every one against the real command's parser without starting anything. Settings
that have no command-line option travel whole, as the component's own settings model in JSON
(`--settings FILE`), so every field of the configuration reaches its component.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from env_workers.envs.base import EnvSettings
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.engine.launch import engine_command
from pipeline.run.config import RollstreamConfig, settings_json
from schemas.prometheus import metrics_url
from streams.app import COMPONENTS

LEARNER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""The learner's OpenMP threads sleep when they wait instead of spinning (libgomp spins first by default, and
reads this once, when torch loads it: hence the environment). Beside engines on the same cores, a spinning thread
burns CPU they would use: on two cores the rollstream side of `bench peer` trained 9% more tokens/s with it, the
learner spending 23% less CPU for the same steps (docs/BENCHMARKS.md, "bench peer"). An OMP_WAIT_POLICY in the
environment `rollstream up` runs in wins."""

# The dispatcher stops on its own after this many training groups; a run is stopped by its learner
# reaching max_steps instead (after which no credit comes back, so nothing more is dispatched).
UNBOUNDED_GROUPS = 1_000_000_000


@dataclass(frozen=True)
class Child:
    """One process of a run: its name, its command and the files to write before it starts."""

    name: str
    argv: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)  # path -> content
    restart_args: tuple[str, ...] = ()
    """Appended when the process is started again after dying (the learner's --resume)."""
    metrics_port: int | None = None
    """Where it serves Prometheus metrics (`with_metrics_port`), the same after a restart."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables it starts with where the inherited environment does not set them."""
    nice: int = 0
    """How much its niceness is raised above ours when it starts (0: left alone; see popen_niced)."""

    def restarted(self) -> Child:
        return replace(self, argv=self.argv + self.restart_args, restart_args=())

    @property
    def metrics_url(self) -> str | None:
        return metrics_url(self.metrics_port) if self.metrics_port is not None else None


def with_metrics_port(child: Child, port: int) -> Child:
    """The child serving Prometheus metrics on `port`: every long-running command takes --metrics-port."""
    return replace(child, argv=child.argv + ("--metrics-port", str(port)), metrics_port=port)


def rollstream(*args: str) -> tuple[str, ...]:
    """A `rollstream` subcommand run by this interpreter (no dependence on PATH or the venv's scripts)."""
    return (sys.executable, "-m", "pipeline.cli", *args)


def command(module: str, *args: str) -> tuple[str, ...]:
    """A run's process: the CLI module of its one command (pipeline/cli/<module>.py) run by this interpreter.
    Not `rollstream <command>`: the whole command line imports every subcommand's libraries (torch,
    transformers, vLLM), seconds of CPU per process taken from the engines starting beside it."""
    return (sys.executable, "-m", f"pipeline.cli.{module}", *args)


def streams_app_id(run: str) -> str:
    """One Faust app per run: its own consumer group, internal topics and changelogs."""
    return f"rollstream-streams.{run}"


def streams_child(cfg: RollstreamConfig, run: str, run_dir: Path, web_port: int,
                  components: tuple[str, ...] = COMPONENTS) -> Child:
    # The run's app starts at the topics' end: `up` commits that (streams.worker.start_at_end)
    # before anything is dispatched, so the worker's own start-up time cannot lose a request.
    settings_path = run_dir / "settings" / "streams.json"
    return Child("streams", command(
        "streams", "worker", "--app-id", streams_app_id(run), "--datadir", str(run_dir / "streams"),
        "--web-port", str(web_port), "--settings", str(settings_path), "--components", ",".join(components),
        "--run", run),
        {str(settings_path): settings_json(cfg.streams)})


def env_worker_children(cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path,
                        engine_urls: dict[str, list[str]], env: EnvSettings) -> list[Child]:
    settings = EnvWorkerSettings(max_concurrency=cfg.env_workers.concurrency, engine_urls=engine_urls,
                                 agent_loop=cfg.agent_loop, env=env, seed=cfg.seed)
    settings_path = run_dir / "settings" / "env_worker.json"
    files = {str(settings_path): settings_json(settings)}
    return [Child(f"env-worker-{i}", command(
        "env_worker", "--run", run, "--model", str(model_dir), "--settings", str(settings_path),
        "--worker-id", f"{run}-env-worker-{i}"), files) for i in range(cfg.env_workers.count)]


def learner_child(cfg: RollstreamConfig, run: str, run_dir: Path, model_dir: Path,
                  engine_urls: dict[str, list[str]], broadcast_port: int, *, resume: bool = False) -> Child:
    settings_path = run_dir / "settings" / "learner.json"
    argv = ["--run", run, "--model", str(model_dir), "--settings", str(settings_path),
            "--max-steps", str(cfg.max_steps), "--broadcast-port", str(broadcast_port)]
    if engine_urls.get("current"):
        argv += ["--broadcast-current", ",".join(engine_urls["current"])]
    if engine_urls.get("stale"):
        argv += ["--broadcast-stale", ",".join(engine_urls["stale"])]
    if resume:
        argv.append("--resume")
    return Child("learner", command("learner", *argv), {str(settings_path): settings_json(cfg.learner_settings())},
                 env=dict(LEARNER_ENV), nice=cfg.learner_nice,
                 restart_args=() if resume else ("--resume",))


def run_config_path(run_dir: Path) -> Path:
    """The run's whole configuration as `up` resolved it (YAML file and environment), for the processes that
    read it (`--config`): one that built it from the environment alone would miss what the run's file set,
    and could even reject it (ROLLSTREAM_MAX_STEPS=72 of a file whose val_interval is 24, against the
    default val_interval of 25)."""
    return run_dir / "settings" / "config.json"


def with_run_config(child: Child, cfg: RollstreamConfig, run_dir: Path) -> Child:
    """The child reading the run's whole configuration (run_config_path) instead of the environment alone;
    a child that already does is returned as it is."""
    if "--config" in child.argv:
        return child
    path = run_config_path(run_dir)
    return replace(child, argv=child.argv + ("--config", str(path)),
                   files={**child.files, str(path): settings_json(cfg, cfg.as_data())})


def dispatcher_child(cfg: RollstreamConfig, run: str, run_dir: Path) -> Child:
    # The whole configuration: the broker, and the environments' settings that size each split.
    config_path = run_config_path(run_dir)
    mix = cfg.mix
    argv = ["--run", run, "--config", str(config_path),
            "--families", ",".join(mix.families), "--max-groups", str(UNBOUNDED_GROUPS),
            "--group-size", str(cfg.streams.group_size), "--batch-size", str(cfg.streams.batch_size),
            "--val-interval", str(mix.val_interval), "--val-group-size", str(mix.val_group_size)]
    if mix.weights:
        argv += ["--weights", ",".join(f"{k}={v}" for k, v in mix.weights.items())]
    if mix.max_in_flight_groups is not None:
        argv += ["--max-in-flight", str(mix.max_in_flight_groups)]
    if mix.val_families:
        argv += ["--val-families", ",".join(mix.val_families)]
        if mix.val_samples is not None:
            argv += ["--val-samples", str(mix.val_samples) if isinstance(mix.val_samples, int)
                     else ",".join(f"{k}={v}" for k, v in mix.val_samples.items())]
    if not mix.val_before_train:
        argv.append("--no-val-before-train")
    return Child("dispatcher", command("dispatch", *argv), {str(config_path): settings_json(cfg, cfg.as_data())})


def engine_args(cfg: RollstreamConfig) -> tuple[str, ...]:
    """Options every engine of the run gets beside its pool, model and port."""
    dtype = ("--dtype", cfg.engines.dtype) if cfg.engines.dtype is not None else ()
    poll = ("--poll-sleep-s", repr(cfg.engines.poll_sleep_s)) if cfg.engines.poll_sleep_s is not None else ()
    return ("--stale-step", str(cfg.streams.stale_step), "--max-model-len", str(cfg.engines.max_model_len), *dtype,
            *poll)


def final_validation_round(cfg: RollstreamConfig) -> int | None:
    """The validation round the dispatcher sends when the learner reaches max_steps (the 'after')."""
    return cfg.max_steps // cfg.mix.val_interval if cfg.mix.val_families else None


def component_settings(cfg: RollstreamConfig, model_dir: Path) -> dict[str, str]:
    """{file name: content} of the settings `rollstream up` gives the streams worker, the env workers and the
    learner (their `--settings FILE`), for deployments that start each process on its own (compose,
    Kubernetes). Env workers get no static engines: they find the engines through their heartbeats."""
    scratch = Path("/nonexistent")  # only the files' contents are used, not their paths
    children = {"streams.json": streams_child(cfg, cfg.run, scratch, 6066),
                "env_worker.json": env_worker_children(cfg, cfg.run, scratch, model_dir, {}, cfg.envs)[0],
                "learner.json": learner_child(cfg, cfg.run, scratch, model_dir, {}, 0)}
    out = {}
    for name, child in children.items():
        (content,) = child.files.values()
        out[name] = content + "\n"
    return out


PROCESSES = ("streams", "env-worker", "learner", "dispatcher", "engine")
"""The processes of a run `rollstream process` can start one at a time (a deployment's services)."""


@dataclass(frozen=True)
class Placement:
    """Where a process started on its own finds the others, and what it calls itself: what `up` knows
    because it starts them all on one machine, and a deployment (compose, Kubernetes) says by name."""

    pool: str = "current"                    # engine: its pool
    engine_id: str = ""                      # engine: its id (default <run>.<pool>)
    port: int = 8000                         # engine: the port it serves on, on every interface
    advertise_host: str = "127.0.0.1"        # engine: the host name others reach it by
    engine_urls: dict[str, list[str]] = field(default_factory=dict)  # learner: its weight broadcast targets
    broadcast_host: str = "127.0.0.1"        # learner: the host name the engines reach it by
    broadcast_port: int = 29600              # learner: its weight-sync groups' port
    worker_id: str = ""                      # env worker: its id (default <run>-env-worker-0, as up's first)


def process_child(cfg: RollstreamConfig, name: str, run_dir: Path, model_dir: Path, placement: Placement) -> Child:
    """The command and settings files of one process of the run, as `up` starts it, for a process started
    on its own: the learner always with --resume (a restarted one continues; a first one starts from the
    policy), engines on every interface."""
    run = cfg.run
    if name == "streams":
        return streams_child(cfg, run, run_dir, 6066)
    if name == "env-worker":
        child = env_worker_children(cfg, run, run_dir, model_dir, {}, cfg.envs)[0]
        if not placement.worker_id:
            return child
        assert child.argv[-2] == "--worker-id"  # up's env workers end with their id
        return replace(child, argv=child.argv[:-1] + (placement.worker_id,))
    if name == "learner":
        child = learner_child(cfg, run, run_dir, model_dir, placement.engine_urls, placement.broadcast_port,
                              resume=True)
        return replace(child, argv=child.argv + ("--broadcast-host", placement.broadcast_host))
    if name == "dispatcher":
        return dispatcher_child(cfg, run, run_dir)
    if name == "engine":
        engine_id = placement.engine_id or f"{run}.{placement.pool}"
        return Child(f"engine-{placement.pool}", tuple(engine_command(
            pool=placement.pool, model_dir=model_dir, run=run, port=placement.port, engine_id=engine_id,
            work_dir=run_dir / "engines" / engine_id, bind_host="0.0.0.0", advertise_host=placement.advertise_host,
            extra_args=engine_args(cfg))))
    raise ValueError(f"unknown process {name!r}: choose from {', '.join(PROCESSES)}")
