"""The learner process (learner/process.py) with its models, clients, signals and, under torchrun,
its ranks: what `rollstream learner` runs once its options are parsed.

Rank 0 leads: it reads `batches`, publishes every version to MinIO and `weights`, and (DDP/FSDP)
tells the other ranks what to do; every other rank follows it (learner/distributed.py).
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import SecretStr

from learner import distributed
from learner.checkpoint import TrainingState
from learner.process import PROMETHEUS, LearnerLoop, ResumeError, TemplateMismatch
from learner.sao import make_critic
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.engine.broadcaster import EngineBroadcaster, PoolBroadcaster
from pipeline.policy.loading import load_policy, policy_template
from pipeline.run.config import RollstreamConfig
from schemas import objectstore, topics
from schemas.bus import EventProducer
from schemas.prometheus import serve_metrics


class LearnerRefused(RuntimeError):
    """The learner cannot go on, for a reason that is one line (a refused resume, another rank's failed
    start); `check_failed` tells a failed check (the batches' chat template is not the policy's) from a
    refusal of what was asked."""

    def __init__(self, message: str, *, check_failed: bool = False) -> None:
        super().__init__(message)
        self.check_failed = check_failed


@dataclass(frozen=True)
class LearnerJob:
    """What one learner process is asked to do (the `rollstream learner` options)."""

    run: str
    model_path: Path
    resume: bool = False
    max_steps: int | None = None
    idle_exit_s: float | None = None
    broadcast_current: str = ""
    broadcast_stale: str = ""
    broadcast_host: str = "127.0.0.1"
    broadcast_port: int = 0


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits after the step in progress."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, *_: object) -> None:
        self.set = True


def _broadcaster(job: LearnerJob, settings: LearnerSettings, api_key: SecretStr | None) -> EngineBroadcaster | None:
    """The fast path to the engines named on the command line, or None (MinIO only)."""
    pools = {}
    for offset, (pool, urls) in enumerate((("current", job.broadcast_current), ("stale", job.broadcast_stale))):
        urls_list = [u.strip() for u in urls.split(",") if u.strip()]
        if urls_list:
            port = job.broadcast_port + offset if job.broadcast_port else 0
            pools[pool] = PoolBroadcaster(pool, urls_list, job.broadcast_host, port, settings.bucket_size_bytes,
                                          backend="nccl" if torch.cuda.is_available() else "gloo", api_key=api_key)
    if not pools:
        return None
    return EngineBroadcaster(pools.get("current"), pools.get("stale"), settings.stale_step)


def run_learner(cfg: RollstreamConfig, settings: LearnerSettings, job: LearnerJob,
                progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Trains until the job's end, a stop signal or an idle timeout; returns rank 0's summary (run, step,
    version, applied batches), None on the other ranks. Raises LearnerRefused."""
    # torchrun's variables: the only place the process reads them.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and settings.sao:
        raise LearnerRefused("learner.advantage_estimator sao trains its critic in one process: run the learner "
                             "without torchrun")
    if world > 1:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    if rank == 0:  # the one rank that talks to the rest of the run
        serve_metrics(settings.metrics_port, "learner", PROMETHEUS, host=settings.metrics_host)
    torch.manual_seed(settings.seed)  # a resume replaces it with the checkpoint's RNG states
    model, ref, model_config = load_policy(job.model_path)
    optimizer = make_optimizer(model, settings)
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if rank != 0:
            _follow(model, ref, optimizer, settings)
            return None
        return _lead(cfg, settings, job, (model, ref, model_config, optimizer), world, stop, progress)
    finally:
        if world > 1:
            # The DDP/FSDP wrapper goes before its process group (_lead drops its references on return):
            # a DDP reducer that outlived the group hung the process at exit.
            dist.destroy_process_group()


def _lead(cfg: RollstreamConfig, settings: LearnerSettings, job: LearnerJob, policy: tuple, world: int,
          stop: _StopFlag, progress: Callable[[str], None]) -> dict[str, Any]:
    """Rank 0: start (or resume) the loop, agree with the other ranks that it started, then train."""
    model, ref, model_config, optimizer = policy
    error = None
    try:
        producer = EventProducer(cfg.kafka, client_id=f"learner-{job.run}")
        mc = objectstore.client(cfg.object_store)
        objectstore.ensure_buckets(mc, [topics.WEIGHTS_BUCKET, topics.CHECKPOINTS_BUCKET])
        critic = make_critic(model, settings) if settings.sao else None
        loop = LearnerLoop(
            run=job.run, settings=settings, model=model, optimizer=optimizer,
            broadcaster=_broadcaster(job, settings, cfg.agent_loop.engine_api_key), critic=critic,
            step_fn=functools.partial(train_step, model, ref, optimizer, settings=settings, critic=critic),
            model_config=model_config, template_fingerprint=policy_template(job.model_path),
            max_steps=job.max_steps, idle_exit_s=job.idle_exit_s, kafka=cfg.kafka, mc=mc, producer=producer,
            should_stop=lambda: stop.set, progress=progress,
        )
        state = loop.start(resume=job.resume)
    except ResumeError as e:
        error = str(e)
    except Exception as e:
        if world > 1:  # the other ranks must not wait for a start that will never come
            distributed.agree_to_start(f"rank 0 failed to start: {e!r}")
        raise
    if world > 1:
        distributed.agree_to_start(error)
    if error is not None:
        raise LearnerRefused(error)
    state = _train(loop, state, model, ref, optimizer, settings, world)
    producer.flush()
    return {"run": job.run, "step": state.step, "version": state.version,
            "applied_batches": len(state.applied_batch_ids)}


def _train(loop: LearnerLoop, state: TrainingState, model: torch.nn.Module, ref: torch.nn.Module,
           optimizer: torch.optim.Optimizer, settings: LearnerSettings, world: int) -> TrainingState:
    """The training loop of rank 0, leading the other ranks when there are any."""
    leader: distributed.Leader | None = None
    if world > 1:
        distributed.sync_from_leader(model, optimizer)
        leader = distributed.Leader(model, distributed.parallelize(model, optimizer, settings), ref, settings)
        loop.step_fn, loop.weights, loop.optimizer_state = leader.step, leader.weights, leader.optimizer_state
    try:
        return loop.loop(state)
    except TemplateMismatch as e:
        raise LearnerRefused(str(e), check_failed=True) from None
    finally:
        if leader is not None:
            leader.stop()


def _follow(model: torch.nn.Module, ref: torch.nn.Module, optimizer: torch.optim.Optimizer,
            settings: LearnerSettings) -> None:
    """A rank other than 0: wait for rank 0's start, take its state, then carry out its commands."""
    error = distributed.agree_to_start(None)
    if error is not None:
        raise LearnerRefused(f"rank {dist.get_rank()}: {error}")
    distributed.sync_from_leader(model, optimizer)
    distributed.follow(model, distributed.parallelize(model, optimizer, settings), ref, settings)
