"""`rollstream learner`: the learner process (learner/process.py) with its models, clients and signals.

One process:      rollstream learner --run r1 --model ./models/default
Resume:           rollstream learner --run r1 --model ./models/default --resume
Several (DDP):    torchrun --nproc_per_node 2 -m pipeline.cli.learner --run-id r1 --model ./models/default
                  (torchrun's own parser takes `--run` for its --run-path, hence --run-id)
Several (FSDP):   the same with --parallelism fsdp (or `parallelism: fsdp` in the settings)
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import typer
from pydantic import ValidationError

from learner import distributed
from learner.process import LearnerLoop, ResumeError, TemplateMismatch
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.engine.broadcaster import EngineBroadcaster, PoolBroadcaster
from pipeline.run.config import load_config
from schemas import objectstore, topics
from schemas.bus import EventProducer
from schemas.template import template_fingerprint

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str) -> NoReturn:
    typer.echo(f"rollstream learner: {message}", err=True)
    raise typer.Exit(code=1)


def load_policy(path: Path) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, Any]]:
    """The policy (float32, CPU) from a Hugging Face checkpoint, its frozen reference copy, and
    its config as config.json holds it."""
    from transformers import AutoModelForCausalLM  # heavy import, only when a model is loaded

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return model, ref, json.loads(model.config.to_json_string())


def policy_template(path: Path) -> str | None:
    """The chat-template fingerprint of the policy's tokenizer; None for a checkpoint without one."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer_config.json").is_file():
        return None
    return template_fingerprint(AutoTokenizer.from_pretrained(str(path)))


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits after the step in progress."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, *_: object) -> None:
        self.set = True


def _broadcaster(current: str, stale: str, host: str, port: int, settings: LearnerSettings) -> EngineBroadcaster | None:
    """The fast path to the engines named on the command line, or None (MinIO only)."""
    pools = {}
    for offset, (pool, urls) in enumerate((("current", current), ("stale", stale))):
        urls_list = [u.strip() for u in urls.split(",") if u.strip()]
        if urls_list:
            pools[pool] = PoolBroadcaster(pool, urls_list, host, port + offset if port else 0, settings.bucket_size_bytes,
                                          backend="nccl" if torch.cuda.is_available() else "gloo")
    if not pools:
        return None
    return EngineBroadcaster(pools.get("current"), pools.get("stale"), settings.stale_step)


@app.command()
def learner(
    run: str = typer.Option(..., "--run", "--run-id",
                            help="Run id: names its versions, checkpoints and consumer group (--run-id under torchrun)."),
    model_path: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory of the initial policy."),
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
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file."),
    settings_file: Path | None = typer.Option(None, "--settings", help="LearnerSettings as JSON (what `rollstream up` "
                                              "passes); the options above override single fields of it."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-step progress line."),
    as_json: bool = typer.Option(False, "--json", help="At exit, one JSON object (step, version) on stdout."),
) -> None:
    """Train on the run's `batches`, publishing every version to MinIO and `weights`.

    Example: rollstream learner --run r1 --model ./models/default --checkpoint-interval 5 --resume
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not (model_path / "config.json").is_file():
        _fail(f"{model_path} is not a Hugging Face checkpoint directory (no config.json)")
    overrides = {k: v for k, v in {"checkpoint_interval": checkpoint_interval, "lr": lr,
                                   "max_tokens_per_micro_batch": max_tokens_per_micro_batch,
                                   "parallelism": parallelism, "stale_step": stale_step}.items() if v is not None}
    try:
        base = json.loads(settings_file.read_text()) if settings_file is not None else {}
        settings = LearnerSettings(**{**base, **overrides})
    except ValidationError as e:
        _fail(f"invalid setting: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}")
    except (OSError, ValueError) as e:
        _fail(f"--settings: {e}")
    cfg = load_config(config)

    # torchrun's variables: the only place the process reads them.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")

    model, ref, model_config = load_policy(model_path)
    optimizer = make_optimizer(model, settings)
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    loop: LearnerLoop | None = None
    leader: distributed.Leader | None = None
    try:
        if rank != 0:
            _follow(model, ref, optimizer, settings)
            return
        error = None
        try:
            producer = EventProducer(cfg.kafka, client_id=f"learner-{run}")
            mc = objectstore.client(cfg.object_store)
            objectstore.ensure_buckets(mc, [topics.WEIGHTS_BUCKET, topics.CHECKPOINTS_BUCKET])
            loop = LearnerLoop(
                run=run, settings=settings, model=model, optimizer=optimizer,
                broadcaster=_broadcaster(broadcast_current, broadcast_stale, broadcast_host, broadcast_port, settings),
                step_fn=functools.partial(train_step, model, ref, optimizer, settings=settings),
                model_config=model_config, template_fingerprint=policy_template(model_path), max_steps=max_steps,
                idle_exit_s=idle_exit, kafka=cfg.kafka, mc=mc, producer=producer, should_stop=lambda: stop.set,
                progress=(lambda line: None) if quiet else (lambda line: typer.echo(line, err=True)),
            )
            state = loop.start(resume=resume)
        except ResumeError as e:
            error = str(e)
        except Exception as e:
            if world > 1:  # the other ranks must not wait for a start that will never come
                distributed.agree_to_start(f"rank 0 failed to start: {e!r}")
            raise
        if world > 1:
            distributed.agree_to_start(error)
        if error is not None:
            _fail(error)
        if world > 1:
            distributed.sync_from_leader(model, optimizer)
            leader = distributed.Leader(model, distributed.parallelize(model, optimizer, settings), ref, settings)
            loop.step_fn, loop.weights, loop.optimizer_state = leader.step, leader.weights, leader.optimizer_state
        try:
            state = loop.loop(state)
        except TemplateMismatch as e:
            _fail(str(e))
        finally:
            if leader is not None:
                leader.stop()
        producer.flush()
        if as_json:
            typer.echo(json.dumps({"run": run, "step": state.step, "version": state.version,
                                   "applied_batches": len(state.applied_batch_ids)}))
    finally:
        if world > 1:
            # The DDP/FSDP wrapper goes before its process group: a DDP reducer that outlived the
            # group hung the process at exit.
            loop = leader = None  # noqa: F841
            dist.destroy_process_group()


def _follow(model: torch.nn.Module, ref: torch.nn.Module, optimizer: torch.optim.Optimizer,
            settings: LearnerSettings) -> None:
    """A rank other than 0: wait for rank 0's start, take its state, then carry out its commands."""
    error = distributed.agree_to_start(None)
    if error is not None:
        _fail(f"rank {dist.get_rank()}: {error}")
    distributed.sync_from_leader(model, optimizer)
    distributed.follow(model, distributed.parallelize(model, optimizer, settings), ref, settings)


if __name__ == "__main__":
    app()
