"""`rollstream process NAME`: one process of a run, started as `rollstream up` starts it (pipeline/run/plan.py)."""

from __future__ import annotations

import enum
import os
import socket
import sys
from pathlib import Path

import typer

from pipeline.cli.engine import Pool
from pipeline.cli.env_worker import parse_engines
from pipeline.cli.toolkit import ConfigOption, fail
from pipeline.run.config import load_config, write_private
from pipeline.run.plan import PROCESSES, Placement, process_child, with_run_config


Process = enum.Enum("Process", {name.replace("-", "_"): name for name in PROCESSES}, type=str)


def process(
    process_name: Process = typer.Argument(..., metavar="NAME", help="The process: " + ", ".join(PROCESSES) + "."),
    config: ConfigOption = None,
    pool: Pool = typer.Option(Pool.current, "--pool", help="engine: its pool, current or stale."),
    engine_id: str = typer.Option("", "--engine-id", help="engine: its id (default RUN.POOL)."),
    port: int = typer.Option(8000, "--port", help="engine: the port it serves on (every interface)."),
    advertise_host: str = typer.Option("127.0.0.1", "--advertise-host", help="engine: the host name others reach it by."),
    engine_url: list[str] = typer.Option([], "--engine-url", help="learner: POOL=URL of an engine to send weights to "
                                         "(repeat for each engine)."),
    broadcast_host: str = typer.Option("127.0.0.1", "--broadcast-host", help="learner: the host name engines reach it by."),
    broadcast_port: int = typer.Option(29600, "--broadcast-port", help="learner: its weight-sync groups' port."),
    worker_id: str = typer.Option("", "--worker-id", help="env worker: its id (default RUN-env-worker-HOSTNAME: "
                                  "scaled containers are told apart by their host names)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=0, max=65535,
                                            help="Serve Prometheus metrics on this port."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Address the metrics bind: 0.0.0.0 for a "
                                     "scraper in another container or host (default loopback)."),
) -> None:
    """Replace this process with one process of the configured run, with the command line and settings files
    `rollstream up` would give it: for deployments that run each process on its own and restart it
    (docker-compose.yml). An engine joins at the version its pool holds now (the learner's latest staged
    version, or the stale pool's multiple of stale_step), fetched from the object store.

    Example: rollstream process learner --config configs/cpu.yaml --engine-url current=http://engine-current:8000
    """
    name = process_name.value
    cfg = load_config(config)
    try:
        urls = parse_engines(engine_url, "--engine-url")
    except ValueError as error:
        fail(str(error))
    pool = pool.value
    engine_id = engine_id or f"{cfg.run}.{pool}"
    worker_id = worker_id or f"{cfg.run}-env-worker-{socket.gethostname()}"
    placement = Placement(pool=pool, engine_id=engine_id, port=port, advertise_host=advertise_host, engine_urls=urls,
                          broadcast_host=broadcast_host, broadcast_port=broadcast_port, worker_id=worker_id)
    run_dir, model_dir, extra = cfg.run_dir(cfg.run), cfg.policy_dir(), ()
    if name == "engine":  # started again by its restart policy: on the version its pool holds now
        from pipeline.run.engines import pool_version_now, rejoin_model
        from pipeline.run.supervision import RunFailed

        try:
            version = pool_version_now(cfg, cfg.run, pool)
            model_dir, extra = rejoin_model(cfg, cfg.run, version, model_dir, run_dir / "engines" / f"{engine_id}.join")
        except RunFailed as error:
            fail(f"engine {engine_id}: {error}")
        print(f"[rollstream] engine {engine_id} joins the {pool} pool at version {version}", file=sys.stderr)
    try:
        child = process_child(cfg, name, run_dir, model_dir, placement)
    except ValueError as error:
        fail(str(error))
    child = with_run_config(child, cfg, run_dir)
    argv = list(child.argv) + list(extra)
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
    for path, content in child.files.items():
        write_private(Path(path), content)
    print(f"[rollstream] process {name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
