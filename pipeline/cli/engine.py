"""`rollstream engine`: one inference engine of the current or the stale pool, supervised by
pipeline/engine/supervisor.py (vLLM's server, heartbeats, weight updates from `weights`)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from pydantic import ValidationError

from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, fail
from pipeline.engine.supervisor import EngineFailed, EngineJob, EngineSettings, run_engine
from pipeline.run.config import load_config, validation_message

app = App(help="Serve a policy with vLLM, with live weight updates and heartbeats.")


class Pool(str, Enum):
    current = "current"
    stale = "stale"


@app.command()
def engine(
    pool: Pool = typer.Option(..., "--pool", help="Engine pool: current (every version) or stale."),
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory to serve."),
    port: int = typer.Option(8000, "--port", help="Port of the OpenAI-compatible server."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on."),
    advertise_url: str = typer.Option("", "--advertise-url", help="URL other hosts reach this engine at, sent in "
                                      "heartbeats (default http://HOST:PORT; set it when HOST is 0.0.0.0)."),
    engine_id: str = typer.Option("", "--engine-id", help="Stable engine id (default: <pool>-<port>)."),
    run: str = typer.Option("", "--run", help="Run whose `weights` to follow (default: the configured run)."),
    initial_version: int = typer.Option(0, "--initial-version", help="Weight version of --model."),
    served_name: str = typer.Option("", "--served-name", help="Model id clients send (default: --model's path). "
                                    "An engine restarted on a later version's directory keeps its run's id."),
    stale_step: int = typer.Option(EngineSettings().stale_step, "--stale-step", help="Stale pool refresh period."),
    max_model_len: int = typer.Option(EngineSettings().max_model_len, "--max-model-len", help="Longest sequence."),
    dtype: str | None = typer.Option(None, "--dtype", help="What vLLM serves in: float32, bfloat16 or auto (bfloat16 "
                                     "on a CPU with AMX-BF16 or AVX512-BF16). Default: float32 on a CPU, vLLM's "
                                     "choice on a GPU."),
    heartbeat_s: float = typer.Option(EngineSettings().heartbeat_interval_s, "--heartbeat-s", help="Heartbeat period."),
    stall_after_s: float = typer.Option(EngineSettings().stall_after_s, "--stall-after-s",
                                        help="Busy with one update or join longer than this: reported unhealthy."),
    work_dir: Path = typer.Option(Path(".run/engines"), "--work-dir", help="Where staged versions are downloaded."),
    hold_weights: bool = typer.Option(EngineSettings().hold_weights, "--hold-weights/--no-hold-weights",
                                      help="Keep the served version's tensors in host memory (one more copy of the "
                                           "weights) and apply delta versions there instead of rebuilding them on disk."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=0, max=65535,
                                            help="Serve the supervisor's Prometheus metrics on this port, 0 any free "
                                                 "one (default none); vLLM's own are at the engine's /metrics."),
    cpus: str = typer.Option(EngineSettings().cpus, "--cpus", help="Cores vLLM's CPU worker binds its threads to: "
                             "auto (vLLM's choice), nobind, or a list such as 0-3,6."),
    poll_sleep_s: float | None = typer.Option(None, "--poll-sleep-s",
                                              help="Seconds vLLM's processes sleep between polls of the queues that "
                                                   "join them; 0 keeps vLLM's spinning loop. Default: 0.0002 on a "
                                                   "CPU, 0 on a GPU."),
    metrics_host: str = typer.Option(EngineSettings().metrics_host, "--metrics-host",
                                     help="Address the supervisor's metrics bind: 0.0.0.0 for a scraper on another "
                                          "host (default loopback)."),
    config: ConfigOption = None,
) -> None:
    """Serve a policy with vLLM; follow `weights` and publish heartbeats until SIGTERM.

    Example: rollstream engine --pool current --model .run/policy --port 8100 --run demo
    """
    cfg = load_config(config)
    if not (model / "config.json").is_file():
        fail(f"{model} is not a Hugging Face checkpoint (no config.json)")
    try:
        settings = EngineSettings(pool=pool.value, stale_step=stale_step, max_model_len=max_model_len, dtype=dtype,
                                  heartbeat_interval_s=heartbeat_s, stall_after_s=stall_after_s,
                                  metrics_port=metrics_port, metrics_host=metrics_host, cpus=cpus,
                                  hold_weights=hold_weights, poll_sleep_s=poll_sleep_s)
    except ValidationError as error:
        fail(validation_message(error))
    job = EngineJob(model=model, run=run or cfg.run, engine_id=engine_id or f"{pool.value}-{port}", host=host,
                    port=port, advertise_url=advertise_url, initial_version=initial_version, work_dir=work_dir,
                    served_name=served_name)
    try:
        run_engine(cfg, settings, job)
    except EngineFailed as error:
        fail(str(error), CHECK_FAILED)


if __name__ == "__main__":
    app()
