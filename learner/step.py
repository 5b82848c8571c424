"""One learner step: reference log-probs, actor forward/backward per micro-batch, clip, AdamW.

`train_step` is pure with respect to I/O: it takes models, an optimizer and plain arrays, and
returns metrics; consuming `batches`, publishing weights and checkpointing happen around it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from learner.loss import next_token_logits, policy_loss, token_entropy, token_logprobs
from learner.microbatch import BatchItem, MicroBatch, make_micro_batches
from learner.settings import LearnerSettings


def make_optimizer(model: torch.nn.Module, settings: LearnerSettings) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the settings' lr, betas and weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.adam_betas, weight_decay=settings.weight_decay
    )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def train_step(
    model: torch.nn.Module,
    ref_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_items: Sequence[BatchItem],
    settings: LearnerSettings,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """One optimizer step on a whole batch; returns actor/* metrics, grad norm, tokens, timings.

    batch_items are (input_ids, loss_mask, rollout_logprobs, advantage) per trajectory.
    """
    # --- plan: micro-batches by token budget; the token-mean divides by the batch's action tokens ---
    micro_batches: list[MicroBatch] = make_micro_batches(batch_items, settings.max_tokens_per_micro_batch)
    global_action_tokens = sum(mb.action_tokens for mb in micro_batches)
    if global_action_tokens == 0:
        raise ValueError("the batch has no action tokens to train on")
    device, ref_device = _device_of(model), _device_of(ref_model)

    # --- phase 1: reference log-probs (frozen initial policy), no graph kept ---
    started = clock()
    ref_model.eval()
    ref_logprobs: list[torch.Tensor] = []
    with torch.no_grad():
        for mb in micro_batches:
            input_ids = _tensor(mb.input_ids, ref_device)  # (B, T)
            logits = next_token_logits(
                ref_model, input_ids, _tensor(mb.attention_mask, ref_device), settings.temperature
            )  # (B, T-1, V)
            ref_logprobs.append(token_logprobs(logits, input_ids).to(device))  # (B, T-1)
    ref_done = clock()

    # --- phase 2: actor forward/backward per micro-batch, gradients accumulate ---
    model.train()
    optimizer.zero_grad(set_to_none=True)
    shares: dict[str, list[torch.Tensor]] = defaultdict(list)  # metric -> per-micro-batch shares, on device
    for mb, ref_lp in zip(micro_batches, ref_logprobs, strict=True):
        input_ids = _tensor(mb.input_ids, device)  # (B, T)
        logits = next_token_logits(model, input_ids, _tensor(mb.attention_mask, device), settings.temperature)
        logprobs = token_logprobs(logits, input_ids)  # (B, T-1)
        entropy = token_entropy(logits if settings.entropy_coef > 0 else logits.detach())  # (B, T-1)
        loss, metrics = policy_loss(
            logprobs,
            _tensor(mb.rollout_logprobs, device),
            ref_lp,
            _tensor(mb.advantages, device),
            _tensor(mb.loss_mask, device),
            entropy,
            global_action_tokens,
            clip_ratio_low=settings.clip_ratio_low,
            clip_ratio_high=settings.clip_ratio_high,
            clip_ratio_c=settings.clip_ratio_c,
            kl_coef=settings.kl_coef,
            kl_clamp=settings.kl_clamp,
            entropy_coef=settings.entropy_coef,
        )
        loss.backward()
        for name, value in (metrics | {"actor/loss": loss.detach()}).items():
            shares[name].append(value)

    # --- phase 3: clip, step, free the gradients ---
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], settings.grad_clip
    )
    grad_norm_value = float(grad_norm)  # CPU-GPU sync point, once per step
    # A non-finite norm would write NaN into every weight; verl skips such a step, and so do we.
    step_skipped = not math.isfinite(grad_norm_value)
    if not step_skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    actor_done = clock()

    # Each share is already divided by the batch's action tokens, so their sum is the token-mean.
    result = {name: float(torch.stack(values).sum()) for name, values in shares.items()}
    result.update(
        {
            "actor/grad_norm": grad_norm_value,
            "actor/step_skipped": float(step_skipped),
            "actor/action_tokens": float(global_action_tokens),
            "actor/tokens": float(sum(int(mb.attention_mask.sum()) for mb in micro_batches)),
            "actor/micro_batches": float(len(micro_batches)),
            "timing/ref_s": ref_done - started,
            "timing/actor_s": actor_done - ref_done,
        }
    )
    return result
