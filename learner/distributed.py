"""More than one learner process (torchrun): the ranks split each batch and train with DDP or FSDP2.

Launch: `torchrun --nproc_per_node 2 -m pipeline.cli.learner --run-id RUN --model PATH`. Rank 0 alone
talks to Kafka and MinIO (it consumes `batches`, publishes, checkpoints). It drives the other
ranks with commands over the process group (`Leader`), which they carry out (`follow`): train
a batch (learner/step.py's train_step, each rank its share), gather the full weights or the full
optimizer state (a collective under FSDP, where each rank holds a shard; rank 0 gets the whole
tensors, on CPU), stop. Gloo on CPUs, NCCL on GPUs.

Start-up: rank 0 loads the checkpoint into the whole, unwrapped policy (or fails to: a
`ResumeError`), then `agree_to_start` tells every rank whether it did, so a failure ends every
rank at once instead of leaving the others in a collective until the Gloo timeout. On success
`sync_from_leader` gives every rank rank 0's weights and optimizer state, and `parallelize`
wraps the policy: DDP replicates it; FSDP2 (`fully_shard`) shards each decoder layer and then the
rest (embeddings, tied lm_head, final norm) as one root group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from learner.checkpoint import full_optimizer_state, full_weights
from learner.microbatch import BatchItem
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step


@dataclass(frozen=True)
class RankSync:
    """learner/step.py's GradientSync over the default process group."""

    rank: int
    world: int
    skip: Callable[[], contextlib.AbstractContextManager[None]]

    def skip_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.skip()

    def sum_over_ranks(self, totals: torch.Tensor) -> None:
        dist.all_reduce(totals)


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    # FSDP2 has no no_sync(): gradients stay unsharded and unreduced until the flag is set back.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class Parallel:
    """The policy as the ranks share it: what train_step runs on, and its optimizer."""

    module: torch.nn.Module  # the DDP wrapper, or the policy itself sharded in place by FSDP
    optimizer: torch.optim.Optimizer  # over module's parameters (a new one under FSDP)
    sync: RankSync


def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the classes a Hugging Face model lists as never to be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def parallelize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LearnerSettings) -> Parallel:
    """Wraps the policy for settings.parallelism; every rank must already hold the same weights and
    optimizer state (`sync_from_leader`). Under FSDP the model is sharded in place and the
    optimizer is replaced by one over the shards, carrying the old one's state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if settings.parallelism == "ddp":
        ddp = DistributedDataParallel(model)
        return Parallel(ddp, optimizer, RankSync(rank, world, ddp.no_sync))
    # Keyed by parameter name, before sharding, on every rank (the whole-state gather keeps it on rank 0 only).
    state = get_optimizer_state_dict(model, optimizer) if optimizer.state else None
    for unit in _shard_units(model):
        fully_shard(unit)
    fully_shard(model)  # the root: embeddings (with lm_head when tied) and the final norm
    sharded = make_optimizer(model, settings)
    if state is not None:
        set_optimizer_state_dict(model, sharded, state, options=StateDictOptions(full_state_dict=True))
    return Parallel(model, sharded, RankSync(rank, world, lambda: _fsdp_no_sync(model)))


def agree_to_start(error: str | None) -> str | None:
    """Rank 0's start-up error (None: started) on every rank; each rank passes its own, only rank 0's counts."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_from_leader(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Makes every rank's weights and optimizer state rank 0's (after rank 0 loaded a checkpoint)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    box = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0])


# Commands rank 0 sends; every rank then runs the same code, so collectives pair up in order.
_STEP, _WEIGHTS, _OPTIMIZER, _STOP = "step", "weights", "optimizer", "stop"


def _command(command: str | None = None, items: Sequence[BatchItem] | None = None) -> tuple[str, Any]:
    box = [(command, list(items) if items is not None else None)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _carry_out(command: str, items: Any, model: torch.nn.Module, parallel: Parallel, ref_model: torch.nn.Module,
               settings: LearnerSettings) -> Any:
    if command == _STEP:
        return train_step(parallel.module, ref_model, parallel.optimizer, items, settings, sync=parallel.sync)
    if command == _WEIGHTS:
        return full_weights(model)
    if command == _OPTIMIZER:
        return full_optimizer_state(model, parallel.optimizer)
    raise ValueError(f"unknown learner command {command!r}")


@dataclass(frozen=True)
class Leader:
    """Rank 0's side: each call tells the other ranks to do the same, then does it.

    `model` is the policy (sharded in place under FSDP; under DDP the module DDP wraps)."""

    model: torch.nn.Module
    parallel: Parallel
    ref_model: torch.nn.Module
    settings: LearnerSettings

    def step(self, items: Sequence[BatchItem]) -> dict[str, float]:
        """One optimizer step on the whole batch (learner/process.py's StepFn)."""
        return self._run(_STEP, items)

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The full state dict, on rank 0."""
        return self._run(_WEIGHTS)

    def optimizer_state(self) -> dict[str, Any]:
        """The full optimizer state, keyed by parameter name, on rank 0."""
        return self._run(_OPTIMIZER)

    def stop(self) -> None:
        """Ends `follow` on the other ranks."""
        _command(_STOP)

    def _run(self, command: str, items: Sequence[BatchItem] | None = None) -> Any:
        _command(command, items)
        return _carry_out(command, items, self.model, self.parallel, self.ref_model, self.settings)


def follow(model: torch.nn.Module, parallel: Parallel, ref_model: torch.nn.Module, settings: LearnerSettings) -> int:
    """The loop of ranks other than 0: carry out rank 0's commands until it says stop; returns the steps taken."""
    steps = 0
    while True:
        command, items = _command()
        if command == _STOP:
            return steps
        _carry_out(command, items, model, parallel, ref_model, settings)
        steps += command == _STEP
