"""`rollstream learner`: the learner process (pipeline/run/learner.py, learner/process.py).

One process:      rollstream learner --run r1 --model ./models/default
Resume:           rollstream learner --run r1 --model ./models/default --resume
Several (DDP):    torchrun --nproc_per_node 2 -m pipeline.cli.learner --run-id r1 --model ./models/default
                  (torchrun's own parser takes `--run` for its --run-path, hence --run-id)
Several (FSDP):   the same with --parallelism fsdp (or `parallelism: fsdp` in the settings)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from learner.settings import LearnerSettings
from pipeline.cli.toolkit import (
    BAD_INPUT,
    CHECK_FAILED,
    App,
    ConfigOption,
    JsonOption,
    ModelOption,
    QuietOption,
    SettingsOption,
    fail,
)
from pipeline.run.config import load_config
from pipeline.run.learner import LearnerJob, LearnerRefused, run_learner

app = App()


def _settings(settings_file: Path | None, overrides: dict[str, Any]) -> LearnerSettings:
    """The --settings file's LearnerSettings with the single-field options over it."""
    try:
        base = json.loads(settings_file.read_text()) if settings_file is not None else {}
        return LearnerSettings(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
    except ValidationError as e:
        fail(f"invalid setting: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}")
    except (OSError, ValueError) as e:
        fail(f"--settings: {e}")


@app.command()
def learner(
    run: Annotated[str, typer.Option("--run", "--run-id", help="Run id: names its versions, checkpoints and consumer "
                                     "group (--run-id under torchrun).")],
    model_path: ModelOption,
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its latest checkpoint."),
    checkpoint_interval: int | None = typer.Option(None, help="Steps between checkpoints (default: settings)."),
    lr: float | None = typer.Option(None, help="AdamW learning rate (default: settings, 1e-6)."),
    max_tokens_per_micro_batch: int | None = typer.Option(None, help="Micro-batch token budget (default: settings)."),
    parallelism: str | None = typer.Option(None, help="ddp or fsdp: how torchrun's ranks share the model (default: settings, ddp)."),
    max_steps: int | None = typer.Option(None, min=1, help="Stop once the run has taken this many steps."),
    idle_exit: float | None = typer.Option(None, min=0.001, help="Stop after this many seconds without a batch."),
    broadcast_current: str = typer.Option("", "--broadcast-current",
                                          help="Comma-separated engine URLs of the current pool: every version goes to them by broadcast."),
    broadcast_stale: str = typer.Option("", "--broadcast-stale",
                                        help="Comma-separated engine URLs of the stale pool: every --stale-step-th version."),
    broadcast_host: str = typer.Option("127.0.0.1", "--broadcast-host", help="Address the engines reach this learner at."),
    broadcast_port: int = typer.Option(0, "--broadcast-port", min=0,
                                       help="First port of the weight-sync groups (current; stale +1); 0 = free ports "
                                            "picked as each group forms."),
    stale_step: int | None = typer.Option(None, "--stale-step", help="Versions between stale-pool refreshes (default: settings, AgentRL's 25)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=0, max=65535,
                                            help="Serve Prometheus metrics on this port, 0 any free one (default: "
                                                 "settings, none)."),
    metrics_host: str | None = typer.Option(None, "--metrics-host",
                                            help="Address the metrics bind: 0.0.0.0 for a scraper on another host "
                                                 "(default: settings, loopback)."),
    config: ConfigOption = None,
    settings_file: SettingsOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Train on the run's `batches`, publishing every version to MinIO and `weights`.

    Example: rollstream learner --run r1 --model ./models/default --checkpoint-interval 5 --resume
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(config)
    if not (model_path / "config.json").is_file():
        fail(f"{model_path} is not a Hugging Face checkpoint directory (no config.json)")
    settings = _settings(settings_file, {"checkpoint_interval": checkpoint_interval, "lr": lr,
                                         "max_tokens_per_micro_batch": max_tokens_per_micro_batch,
                                         "parallelism": parallelism, "stale_step": stale_step,
                                         "metrics_port": metrics_port, "metrics_host": metrics_host})
    job = LearnerJob(run=run, model_path=model_path, resume=resume, max_steps=max_steps, idle_exit_s=idle_exit,
                     broadcast_current=broadcast_current, broadcast_stale=broadcast_stale,
                     broadcast_host=broadcast_host, broadcast_port=broadcast_port)
    try:
        summary = run_learner(cfg, settings, job, (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True)))
    except LearnerRefused as error:
        fail(str(error), CHECK_FAILED if error.check_failed else BAD_INPUT)
    if as_json and summary is not None:
        typer.echo(json.dumps(summary))


if __name__ == "__main__":
    app()
