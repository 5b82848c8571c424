"""One learner step: reference log-probs, actor forward/backward per micro-batch, clip, AdamW.

With `policy_loss: decoupled` or an `is_correction` (learner/loss.py), the step first recomputes the
actor's own log-probs under no_grad, once, like the reference pass: the proximal/old policy of the
loss. Plain ppo skips that pass, so it costs one actor forward per micro-batch less.

With `advantage_estimator: sao` (learner/sao.py) the batch carries each trajectory's reward instead
of its advantage: the actor's forward also yields the final hidden states, the value head turns
them into V(s_t), skip-observation GAE turns the rewards into per-token advantages and returns, the
actor trains on the DIS-gated loss (learner/loss.py dis_policy_loss), and after the actor's step the
critic takes `critic_updates_per_step` steps on the action tokens' features and returns (phase 4).
No extra forward: the features come from the actor's own pass, and the weights they come from move
only after it. One process only (the critic is not shared across ranks).

`train_step` is pure with respect to I/O: it takes models, an optimizer and plain arrays, and
returns metrics; consuming `batches`, publishing weights and checkpointing happen around it.

The same function runs in one process and on each of W ranks (learner/distributed.py passes a
`GradientSync`). Every rank plans the same micro-batches from the whole batch, so each
micro-batch loss is already its share of the *global* token-mean; rank r trains micro-batches
r, r+W, ... (`rank_share`), DDP/FSDP average the gradients over the W ranks, so each rank scales
its loss by W and the averaged gradient is the sum of all shares: the single-process gradient,
up to float summation order. Every rank must join each gradient all-reduce, so all ranks run the
same number of backward passes (a rank with one micro-batch fewer repeats one with weight 0) and
only the last backward syncs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from learner import sao
from learner.loss import dis_policy_loss, next_token_logits, policy_loss, token_entropy, token_logprobs
from learner.microbatch import BatchItem, MicroBatch, make_micro_batches, rank_share, split_updates
from learner.settings import LearnerSettings
from schemas.precision import host_cpu_flags, learner_dtype


class GradientSync(Protocol):
    """How the ranks of a process group share one step (learner/distributed.py implements it)."""

    rank: int
    world: int

    def skip_sync(self) -> contextlib.AbstractContextManager[None]:
        """A backward inside it accumulates locally, without the gradient all-reduce."""

    def sum_over_ranks(self, totals: torch.Tensor) -> None:
        """Sums `totals` over the ranks, in place."""


def make_optimizer(model: torch.nn.Module, settings: LearnerSettings) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the settings' lr, betas and weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.adam_betas, weight_decay=settings.weight_decay
    )


def warmup_lr(settings: LearnerSettings, steps_taken: int) -> float:
    """The learning rate of the step after `steps_taken` optimizer steps: linear warmup, then `lr`."""
    if steps_taken >= settings.lr_warmup_steps:
        return settings.lr
    return settings.lr * (steps_taken + 1) / settings.lr_warmup_steps


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far, from the optimizer's own state (so a resumed learner, whose
    optimizer state comes from its checkpoint, continues the schedule where it stopped)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(step)
    return 0


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def _total_norm(grad_norm: torch.Tensor) -> float:
    # Under FSDP2 the norm is a replicated DTensor; full_tensor() reads its value.
    full = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return float(full)  # CPU-GPU sync point, once per step


def forward_precision(settings: LearnerSettings, device: torch.device) -> contextlib.AbstractContextManager:
    """The policy's forward passes in the learner's compute dtype (schemas/precision.py): under bfloat16, torch
    autocast runs the matrix products in bfloat16 while the weights, AdamW's state and the loss stay float32
    (next_token_logits returns float32 logits)."""
    dtype = learner_dtype(settings.compute_dtype, on_gpu=device.type == "cuda", flags=host_cpu_flags())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def train_step(
    model: torch.nn.Module,
    ref_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_items: Sequence[BatchItem],
    settings: LearnerSettings,
    *,
    sync: GradientSync | None = None,
    critic: sao.Critic | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """One batch's optimizer steps (one, or `updates_per_batch` on its mini-batches); returns actor/* metrics
    (token-means over the batch), grad norm (the updates' mean), tokens, timings.

    batch_items are (input_ids, loss_mask, rollout_logprobs, advantage) per trajectory; with SAO
    (settings.advantage_estimator "sao", which needs `critic`) the last is the trajectory's reward,
    and the critic's metrics (critic/*) come back too. With `sync`, every rank passes the whole batch,
    trains its share, and gets the same metrics back (summed over ranks).
    """
    if settings.sao and critic is None:
        raise ValueError("advantage_estimator sao needs the critic (learner/sao.py make_critic)")
    if settings.sao and sync is not None:
        raise ValueError("advantage_estimator sao trains its critic in one process; run the learner without torchrun")
    # --- plan: the batch in `updates_per_batch` consecutive mini-batches, one optimizer step each, each mini-batch in
    # micro-batches by token budget; an update's token-mean divides by its own mini-batch's action tokens ---
    # Shared prompts run once per micro-batch in one process; torchrun's DDP/FSDP wrappers expect one forward per
    # backward, and SAO's critic reads every position's features.
    share_prompts = settings.share_prompts and sync is None and critic is None
    updates: list[list[MicroBatch]] = [
        make_micro_batches(part, settings.max_tokens_per_micro_batch, share_prompts=share_prompts)
        # A batch smaller than updates_per_batch (a filtered, short one) takes one update per trajectory.
        for part in split_updates(batch_items, min(settings.updates_per_batch, len(batch_items)))
    ]
    update_tokens = [sum(mb.action_tokens for mb in micro_batches) for micro_batches in updates]
    global_action_tokens = sum(update_tokens)
    if global_action_tokens == 0:
        raise ValueError("the batch has no action tokens to train on")
    world, rank = (sync.world, sync.rank) if sync is not None else (1, 0)
    shares_of = [rank_share(len(micro_batches), world, rank) for micro_batches in updates]
    device = _device_of(model)

    # --- phase 1: reference log-probs (frozen initial policy) of this rank's micro-batches, no graph kept ---
    started = clock()
    ref_logprobs = [_logprobs_without_graph(ref_model, [micro_batches[index] for index, _ in share], settings, device)
                    for micro_batches, share in zip(updates, shares_of, strict=True)]
    ref_done = clock()

    # --- phase 1b (decoupled, corrections): the actor's own log-probs before this step changes it, no graph ---
    # Recomputed once, before the first update moves the weights: pi_prox of every micro-batch of every update.
    prox_logprobs: list[list[torch.Tensor | None]] = [
        list(_logprobs_without_graph(model, [micro_batches[index] for index, _ in share], settings, device))
        if settings.needs_prox_logprobs else [None] * len(share)
        for micro_batches, share in zip(updates, shares_of, strict=True)
    ]
    prox_done = clock()

    # --- phases 2-3, once per update: actor forward/backward per micro-batch, gradients accumulating (only the last
    # backward syncs); the metrics summed over ranks; clip and step (on identical gradients), free the gradients ---
    model.train()
    critic_batch: list[_CriticData] = []  # SAO: each micro-batch's action tokens, for phase 4
    metrics_of_batch: dict[str, float] = defaultdict(float)
    grad_norms: list[float] = []
    steps_skipped, lr = 0, warmup_lr(settings, steps_taken(optimizer))
    for micro_batches, share, ref_lp, prox_lp, tokens in zip(updates, shares_of, ref_logprobs, prox_logprobs,
                                                             update_tokens, strict=True):
        if tokens == 0:
            continue  # a mini-batch without action tokens has no gradient (every rank skips it alike)
        optimizer.zero_grad(set_to_none=True)
        shares = _accumulate_gradients(model, micro_batches, share, ref_lp, prox_lp, tokens, settings, sync, world,
                                       critic, critic_batch)
        names = sorted(shares)
        # Each share is already divided by the mini-batch's action tokens, so their sum is its token-mean.
        totals = torch.stack([torch.stack(shares[name]).sum() for name in names])  # (M,)
        if sync is not None:
            sync.sum_over_ranks(totals)
        grad_norm_value, step_skipped, lr = _clip_and_step(optimizer, settings)
        grad_norms.append(grad_norm_value)
        steps_skipped += step_skipped
        # The batch's metrics are the updates' token-means weighted by their tokens: the batch's token-mean.
        weight = tokens / global_action_tokens
        for name, value in zip(names, totals, strict=True):
            metrics_of_batch[name] += float(value) * weight
    actor_done = clock()

    # --- phase 4 (SAO): the critic's updates on the batch's features and GAE returns, after the actor's steps ---
    critic_metrics = _train_critic(critic, critic_batch, settings) if critic is not None else {}
    critic_done = clock()

    result = dict(metrics_of_batch)
    result.update(
        {
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),  # the updates' mean; one update: its norm
            "actor/step_skipped": float(steps_skipped),
            "actor/updates": float(len(grad_norms)),
            "actor/lr": lr,
            "actor/action_tokens": float(global_action_tokens),
            "actor/tokens": float(sum(int(mb.attention_mask.sum()) for mbs in updates for mb in mbs)),
            "actor/micro_batches": float(sum(len(mbs) for mbs in updates)),
            "timing/ref_s": ref_done - started,
            "timing/actor_s": actor_done - prox_done,
        }
    )
    if settings.needs_prox_logprobs:
        result["timing/prox_s"] = prox_done - ref_done
    if critic is not None:
        result.update(critic_metrics)
        result["timing/critic_s"] = critic_done - actor_done
    return result


def _logprobs_without_graph(policy: torch.nn.Module, micro_batches: Sequence[MicroBatch], settings: LearnerSettings,
                            device: torch.device) -> list[torch.Tensor]:
    """The log-probs of each micro-batch's tokens under `policy`, without a graph, on `device`: the frozen
    reference policy's, or the actor's own before the step (the proximal policy)."""
    policy_device = _device_of(policy)
    policy.eval()
    out: list[torch.Tensor] = []
    with torch.no_grad(), forward_precision(settings, policy_device):
        for mb in micro_batches:
            input_ids, p = _tensor(mb.input_ids, policy_device), mb.prefix_len  # (B, T)
            logits = next_token_logits(
                policy, input_ids, _tensor(mb.attention_mask, policy_device), settings.temperature, p
            )  # (B, T-1-P, V)
            out.append(token_logprobs(logits, input_ids[:, p:]).to(device))  # (B, T-1-P)
    return out


def _accumulate_gradients(model: torch.nn.Module, micro_batches: Sequence[MicroBatch],
                          share: Sequence[tuple[int, float]], ref_logprobs: Sequence[torch.Tensor],
                          prox_logprobs: Sequence[torch.Tensor | None], global_action_tokens: int,
                          settings: LearnerSettings, sync: GradientSync | None, world: int,
                          critic: sao.Critic | None = None,
                          critic_batch: list[_CriticData] | None = None) -> dict[str, list[torch.Tensor]]:
    """Forward and backward of this rank's micro-batches; returns metric -> per-micro-batch shares (on device).
    With SAO's `critic`, each micro-batch's action tokens are appended to `critic_batch` for phase 4."""
    device = _device_of(model)
    shares: dict[str, list[torch.Tensor]] = defaultdict(list)
    for n, ((index, weight), ref_lp, prox_lp) in enumerate(zip(share, ref_logprobs, prox_logprobs, strict=True)):
        mb = micro_batches[index]
        local = sync is not None and n < len(share) - 1
        if critic is not None:
            with forward_precision(settings, device):
                loss, metrics = _sao_actor_loss(model, critic, mb, ref_lp, global_action_tokens, settings, critic_batch)
            (loss * weight).backward()  # one process: no rank scaling
            for name, value in (metrics | {"actor/loss": loss.detach()}).items():
                shares[name].append(value * weight)
            continue
        with sync.skip_sync() if local else contextlib.nullcontext():
            # From the shared prefix's end on (P = 0 without one): nothing before it is an action token.
            input_ids, p = _tensor(mb.input_ids, device), mb.prefix_len  # (B, T)
            with forward_precision(settings, device):
                logits = next_token_logits(model, input_ids, _tensor(mb.attention_mask, device), settings.temperature, p)
            logprobs = token_logprobs(logits, input_ids[:, p:])  # (B, T-1-P)
            entropy = token_entropy(logits if settings.entropy_coef > 0 else logits.detach())  # (B, T-1-P)
            loss, metrics = policy_loss(
                logprobs,
                _tensor(mb.rollout_logprobs[:, p:], device),
                ref_lp,
                _tensor(mb.advantages[:, p:], device),
                _tensor(mb.loss_mask[:, p:], device),
                entropy,
                global_action_tokens,
                clip_ratio_low=settings.clip_ratio_low,
                clip_ratio_high=settings.clip_ratio_high,
                clip_ratio_c=settings.clip_ratio_c,
                kl_coef=settings.kl_coef,
                kl_clamp=settings.kl_clamp,
                entropy_coef=settings.entropy_coef,
                prox_logprobs=prox_lp,
                objective=settings.policy_loss,
                is_correction=settings.is_correction,
                is_level=settings.is_level,
                is_cap=settings.is_cap,
            )
            # x world: DDP and FSDP average gradients over ranks; the step wants the sum of the shares.
            (loss * (weight * world)).backward()
        for name, value in (metrics | {"actor/loss": loss.detach()}).items():
            shares[name].append(value * weight)
    return shares


@dataclass(frozen=True)
class _CriticData:
    """One micro-batch's action tokens as the critic needs them: features (N, H) and, each (N,), the values
    the advantages were computed with, the GAE returns and the advantages."""

    features: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor


def _sao_actor_loss(model: torch.nn.Module, critic: sao.Critic, mb: MicroBatch, ref_lp: torch.Tensor,
                    global_action_tokens: int, settings: LearnerSettings,
                    critic_batch: list[_CriticData]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAO on one micro-batch: the actor's forward with its final hidden states, V(s_t) from the value head,
    skip-observation GAE from the rows' rewards, then the DIS-gated actor loss. Keeps the action tokens'
    features, values, returns and advantages in `critic_batch`."""
    device = _device_of(model)
    input_ids = _tensor(mb.input_ids, device)  # (B, T)
    logits, features = sao.next_token_logits_and_features(model, input_ids, _tensor(mb.attention_mask, device),
                                                          settings.temperature)  # (B, T-1, V), (B, T-1, H)
    logprobs = token_logprobs(logits, input_ids)  # (B, T-1)
    entropy = token_entropy(logits if settings.entropy_coef > 0 else logits.detach())  # (B, T-1)

    # --- critic: V(s_t) before this step's updates; GAE over the policy's own tokens, reward on the last ---
    with torch.no_grad():
        values = critic.head(features)  # (B, T-1)
    # The recursion runs on the CPU, one Python step per action token (a CPU-GPU sync point per micro-batch):
    # written as the formula reads; about 0.7 us per action token here, little beside the forward and backward.
    advantages_np, returns_np = sao.batch_gae(values.double().cpu().numpy(), mb.loss_mask, mb.signals,
                                              settings.gae_gamma, settings.gae_lambda)  # (B, T-1) each
    advantages = torch.from_numpy(advantages_np).to(device, torch.float32)  # (B, T-1)
    returns = torch.from_numpy(returns_np).to(device, torch.float32)  # (B, T-1)
    action = torch.from_numpy(mb.loss_mask > 0).to(device)  # (B, T-1)
    critic_batch.append(_CriticData(features[action], values[action], returns[action], advantages[action]))

    # --- actor: the DIS-gated policy gradient on those advantages ---
    return dis_policy_loss(
        logprobs,
        _tensor(mb.rollout_logprobs, device),
        ref_lp,
        advantages,
        _tensor(mb.loss_mask, device),
        entropy,
        global_action_tokens,
        dis_low=settings.dis_low,
        dis_high=settings.dis_high,
        kl_coef=settings.kl_coef,
        kl_clamp=settings.kl_clamp,
        entropy_coef=settings.entropy_coef,
    )


def _train_critic(critic: sao.Critic, critic_batch: Sequence[_CriticData],
                  settings: LearnerSettings) -> dict[str, float]:
    """The critic's updates on the whole batch's action tokens, with the diagnostics of the values the
    advantages were computed with (CleanRL's explained variance)."""
    values = torch.cat([d.values for d in critic_batch])  # (N,)
    returns = torch.cat([d.returns for d in critic_batch])  # (N,)
    advantages = torch.cat([d.advantages for d in critic_batch])  # (N,)
    diagnostics = {
        "critic/values_mean": float(values.mean()),
        "critic/returns_mean": float(returns.mean()),
        "critic/explained_variance": sao.explained_variance(values, returns),
        "actor/advantage_mean": float(advantages.mean()),
        "actor/advantage_std": float(advantages.std(unbiased=False)),
    }
    features = torch.cat([d.features for d in critic_batch])  # (N, H)
    return diagnostics | sao.update_critic(critic, features, returns, settings)


def _clip_and_step(optimizer: torch.optim.Optimizer, settings: LearnerSettings) -> tuple[float, bool, float]:
    """Clips the gradients, steps unless their norm is not finite, frees them; (grad norm, skipped, lr)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], settings.grad_clip
    )
    grad_norm_value = _total_norm(grad_norm)
    # A non-finite norm would write NaN into every weight; verl skips such a step, and so do we.
    step_skipped = not math.isfinite(grad_norm_value)
    lr = warmup_lr(settings, steps_taken(optimizer))
    if not step_skipped:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm_value, step_skipped, lr
