"""More than one learner process (torchrun): the ranks split each batch and train with DDP.

Launch: `torchrun --nproc_per_node 2 -m pipeline.learner_cmd --run-id RUN --model PATH`. Rank 0 alone
talks to Kafka and MinIO (it consumes `batches`, publishes, checkpoints); it hands each batch to
the other ranks over the process group, every rank takes its share of the micro-batches, and DDP
all-reduces the gradients once per step. Gloo on CPUs, NCCL on GPUs (learner/broadcast.py).

Equality with one process. Every rank plans the same micro-batches from the whole batch
(learner/microbatch.py), so all ranks know the batch's action-token count, and each micro-batch
loss is already its share of the *global* token-mean. Rank r trains micro-batches r, r+W, ...;
DDP averages gradients over the W ranks, so each rank scales its loss by W, and the averaged
gradient is the sum of all shares: the single-process gradient, up to float summation order.
DDP syncs on every backward outside `no_sync()`, and every rank must join each sync, so all
ranks run the same number of backward passes: a rank with one micro-batch fewer repeats one
with weight 0 (one extra forward/backward at most), and only the last backward syncs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from learner.loss import next_token_logits, policy_loss, token_entropy, token_logprobs
from learner.microbatch import BatchItem, make_micro_batches
from learner.settings import LearnerSettings
from learner.step import train_step


def rank_share(micro_batches: int, world: int, rank: int) -> list[tuple[int, float]]:
    """(micro-batch index, loss weight) that `rank` trains: its round-robin share, padded with a
    weight-0 repeat so that every rank runs ceil(micro_batches / world) backward passes."""
    if micro_batches <= 0:
        raise ValueError("a step needs at least one micro-batch")
    passes = math.ceil(micro_batches / world)
    own = [(i, 1.0) for i in range(rank, micro_batches, world)]
    filler = own[0][0] if own else 0
    return own + [(filler, 0.0)] * (passes - len(own))


def ddp_train_step(
    model: DistributedDataParallel,
    ref_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_items: Sequence[BatchItem],
    settings: LearnerSettings,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """learner/step.py's train_step over W ranks; every rank passes the whole batch and gets the
    same metrics back (summed over ranks). Metric names are train_step's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    micro_batches = make_micro_batches(batch_items, settings.max_tokens_per_micro_batch)
    global_action_tokens = sum(mb.action_tokens for mb in micro_batches)
    if global_action_tokens == 0:
        raise ValueError("the batch has no action tokens to train on")
    share = rank_share(len(micro_batches), world, rank)
    device = next(model.parameters()).device

    # --- phase 1: reference log-probs of this rank's micro-batches ---
    started = clock()
    ref_model.eval()
    ref_logprobs = []
    with torch.no_grad():
        for index, _ in share:
            mb = micro_batches[index]
            input_ids = torch.from_numpy(mb.input_ids).to(device)  # (B, T)
            logits = next_token_logits(ref_model, input_ids, torch.from_numpy(mb.attention_mask).to(device),
                                       settings.temperature)  # (B, T-1, V)
            ref_logprobs.append(token_logprobs(logits, input_ids))  # (B, T-1)
    ref_done = clock()

    # --- phase 2: actor forward/backward; only the last backward all-reduces ---
    model.train()
    optimizer.zero_grad(set_to_none=True)
    shares: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
    for n, ((index, weight), ref_lp) in enumerate(zip(share, ref_logprobs, strict=True)):
        mb = micro_batches[index]
        input_ids = torch.from_numpy(mb.input_ids).to(device)  # (B, T)
        sync = n == len(share) - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            logits = next_token_logits(model, input_ids, torch.from_numpy(mb.attention_mask).to(device),
                                       settings.temperature)  # (B, T-1, V)
            logprobs = token_logprobs(logits, input_ids)  # (B, T-1)
            entropy = token_entropy(logits if settings.entropy_coef > 0 else logits.detach())  # (B, T-1)
            loss, metrics = policy_loss(
                logprobs, torch.from_numpy(mb.rollout_logprobs).to(device), ref_lp,
                torch.from_numpy(mb.advantages).to(device), torch.from_numpy(mb.loss_mask).to(device), entropy,
                global_action_tokens, clip_ratio_low=settings.clip_ratio_low,
                clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
                kl_coef=settings.kl_coef, kl_clamp=settings.kl_clamp, entropy_coef=settings.entropy_coef,
            )
            # x world: DDP averages over ranks, we want the sum of the token-mean shares.
            (loss * (weight * world)).backward()
        for name, value in (metrics | {"actor/loss": loss.detach()}).items():
            shares[name] = shares[name] + value * weight

    # --- phase 3: metrics summed over ranks, then clip and step on identical gradients ---
    names = sorted(shares)
    totals = torch.stack([shares[name] for name in names])  # (M,)
    dist.all_reduce(totals)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], settings.grad_clip
    )
    grad_norm_value = float(grad_norm)
    step_skipped = not math.isfinite(grad_norm_value)  # as train_step: never write NaN into the weights
    if not step_skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    actor_done = clock()
    result = {name: float(v) for name, v in zip(names, totals, strict=True)}
    result.update({
        "actor/grad_norm": grad_norm_value,
        "actor/step_skipped": float(step_skipped),
        "actor/action_tokens": float(global_action_tokens),
        "actor/tokens": float(sum(int(mb.attention_mask.sum()) for mb in micro_batches)),
        "actor/micro_batches": float(len(micro_batches)),
        "timing/ref_s": ref_done - started,
        "timing/actor_s": actor_done - ref_done,
    })
    return result


def share_batch(items: Sequence[BatchItem] | None) -> list[BatchItem] | None:
    """Rank 0's batch on every rank (None from rank 0 tells the others to stop)."""
    box = [list(items) if items is not None else None]
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


def leader_step_fn(
    model: DistributedDataParallel, ref_model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    settings: LearnerSettings,
) -> Callable[[Sequence[BatchItem]], dict[str, float]]:
    """Rank 0's step: hand the batch to the other ranks, then train its share."""

    def step(items: Sequence[BatchItem]) -> dict[str, float]:
        share_batch(items)
        return ddp_train_step(model, ref_model, optimizer, items, settings)

    return step


def follow(
    model: DistributedDataParallel, ref_model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    settings: LearnerSettings,
) -> int:
    """The loop of ranks other than 0: train each batch rank 0 hands over until it says stop."""
    steps = 0
    while (items := share_batch(None)) is not None:
        ddp_train_step(model, ref_model, optimizer, items, settings)
        steps += 1
    return steps


def single_process_step_fn(
    model: torch.nn.Module, ref_model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    settings: LearnerSettings,
) -> Callable[[Sequence[BatchItem]], dict[str, float]]:
    """The plain step (one process, no process group)."""
    return lambda items: train_step(model, ref_model, optimizer, items, settings)
