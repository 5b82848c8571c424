"""Packing a training batch into micro-batches by a token budget, with next-token alignment.

Budget. A micro-batch is right-padded to its longest sequence, so what it costs in activation
memory is rows x longest row. `plan_micro_batches` keeps that padded size within
`max_tokens_per_micro_batch` (verl's `ppo_max_token_len_per_gpu` plays the same role). It is
first-fit decreasing: sequences sorted by length, longest first (ties by batch position, so the
plan is deterministic), each put into the first micro-batch it fits in. Sorting also groups
similar lengths, which keeps padding small. A sequence longer than the budget gets a micro-batch
of its own (it has to be trained on; the budget is a target, not a reason to drop data).

Alignment (shift by one). For a sequence x_0 .. x_{T-1}, a causal LM's logits at position t give
the distribution of x_{t+1}. So the per-token arrays the loss sees have T-1 positions, and
position t refers to token t+1:

    labels[t]           = input_ids[t + 1]
    loss_mask[t]        = item loss_mask[t + 1]         (1 where x_{t+1} was generated)
    rollout_logprobs[t] = item rollout_logprobs[t + 1]  (the engine's log p(x_{t+1}))
    advantages[t]       = advantage * loss_mask[t]

With SAO (`learner.advantage_estimator: sao`) an item's scalar is its trajectory's reward, not an
advantage: the step computes per-token advantages from it with the critic (learner/sao.py) and reads
each row's scalar from `signals`; `advantages` is then not used.

Token 0 has no prediction, so it can never be an action token (it is the prompt's first token);
an item whose loss_mask[0] is 1 is rejected. Padding positions carry attention_mask 0,
loss_mask 0, rollout log-prob 0 and advantage 0, so they add nothing to the loss.

Shared prompts (`share_prompts`, learner.share_prompts). The members of a GRPO group have the same
prompt, most of their tokens on these tasks (a family's system prompt and tool schemas). Planned
with their prompt as a key, a micro-batch holds only items of one prompt, and its `prefix_len`
counts the leading tokens every row shares up to the first position whose logits predict an action
token: the forward pass runs them once (learner/loss.py next_token_logits), and the per-token arrays
from `prefix_len` on are all the loss needs (nothing before it is an action).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np

# (input_ids (T,), loss_mask (T,), rollout_logprobs (T,), signal): the training content of a batches
# event item, with the arrays unpacked by schemas.arrays. The signal is the item's final advantage, or
# with SAO its trajectory's reward (learner/process.py batch_items).
BatchItem = tuple[np.ndarray, np.ndarray, np.ndarray, float]


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded arrays of a few batch items; per-token arrays are already shifted."""

    indices: tuple[int, ...]  # positions of the items in the batch
    input_ids: np.ndarray  # (B, T) int64, padded with pad_token_id
    attention_mask: np.ndarray  # (B, T) int64, 1 on real tokens
    loss_mask: np.ndarray  # (B, T-1) float32, 1 where token t+1 is an action
    rollout_logprobs: np.ndarray  # (B, T-1) float32
    advantages: np.ndarray  # (B, T-1) float32
    signals: np.ndarray  # (B,) float32, each item's scalar as given (SAO: its reward)
    prefix_len: int = 0  # leading tokens all rows share and no loss needs the logits of (run once); 0: none

    @property
    def action_tokens(self) -> int:
        """Action tokens (loss_mask 1) in this micro-batch."""
        return int(self.loss_mask.sum())


def plan_micro_batches(lengths: Sequence[int], max_tokens: int,
                       keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Groups sequence indices so that rows x longest row <= max_tokens (first-fit decreasing).

    Every index appears exactly once; a sequence longer than `max_tokens` is alone. Within a
    micro-batch the indices are in decreasing length, so the first one sets its padded length.
    With `keys` (one per sequence), a micro-batch holds sequences of one key only.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for members in bins:
            longest = lengths[members[0]]  # decreasing order: the first member is the longest
            if keys is not None and keys[members[0]] != keys[i]:
                continue
            if (len(members) + 1) * longest <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
    return bins


def collate(items: Sequence[BatchItem], indices: Sequence[int], pad_token_id: int = 0) -> MicroBatch:
    """Right-pads the chosen items into one micro-batch and shifts the per-token arrays by one."""
    rows = len(indices)
    width = max(len(items[i][0]) for i in indices)
    input_ids = np.full((rows, width), pad_token_id, dtype=np.int64)  # (B, T)
    attention_mask = np.zeros((rows, width), dtype=np.int64)  # (B, T)
    loss_mask = np.zeros((rows, width), dtype=np.float32)  # (B, T), unshifted for now
    rollout = np.zeros((rows, width), dtype=np.float32)  # (B, T), unshifted for now
    advantage = np.zeros((rows, 1), dtype=np.float32)  # (B, 1)
    for row, i in enumerate(indices):
        ids, mask, logprobs, adv = items[i]
        n = len(ids)
        if not len(mask) == len(logprobs) == n:
            raise ValueError(f"item {i}: input_ids, loss_mask and rollout_logprobs differ in length")
        if n < 2:
            raise ValueError(f"item {i}: a sequence needs at least 2 tokens to predict one")
        if mask[0]:
            raise ValueError(f"item {i}: token 0 cannot be an action token (nothing predicts it)")
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = mask
        rollout[row, :n] = logprobs
        advantage[row, 0] = adv
    shifted_mask = loss_mask[:, 1:]  # (B, T-1): position t -> token t+1
    return MicroBatch(
        indices=tuple(indices),
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=shifted_mask,
        rollout_logprobs=rollout[:, 1:] * shifted_mask,  # (B, T-1)
        advantages=advantage * shifted_mask,  # (B, 1) * (B, T-1) -> (B, T-1)
        signals=advantage[:, 0],  # (B,)
    )


def prompt_key(item: BatchItem) -> bytes:
    """The item's tokens before its first action token: equal for the members of one group."""
    ids, mask = item[0], item[1]
    first_action = int(np.argmax(mask)) if mask.any() else len(ids)
    return np.asarray(ids[:first_action], dtype=np.int64).tobytes()


def shared_prefix_length(micro: MicroBatch) -> int:
    """Leading tokens every row shares, stopping at the first position whose logits predict an action token."""
    same = (micro.input_ids == micro.input_ids[:1]).all(axis=0)  # (T,)
    common = len(same) if same.all() else int(np.argmin(same))
    first_prediction = int(np.argmax(micro.loss_mask.any(axis=0)))  # shifted: position t predicts token t+1
    return min(common, first_prediction)


def make_micro_batches(
    items: Sequence[BatchItem], max_tokens: int, pad_token_id: int = 0, share_prompts: bool = False
) -> list[MicroBatch]:
    """Plans and collates the whole batch: every item lands in exactly one micro-batch. With `share_prompts`,
    items of one prompt are packed together and each micro-batch of several rows has its `prefix_len`."""
    keys = [prompt_key(item) for item in items] if share_prompts else None
    plan = plan_micro_batches([len(item[0]) for item in items], max_tokens, keys)
    micro_batches = [collate(items, indices, pad_token_id) for indices in plan]
    if share_prompts:
        micro_batches = [replace(mb, prefix_len=shared_prefix_length(mb)) if len(mb.indices) > 1 else mb
                         for mb in micro_batches]
    return micro_batches


def split_updates(items: Sequence[BatchItem], updates: int) -> list[list[BatchItem]]:
    """The batch's items in `updates` consecutive runs (learner.updates_per_batch), their sizes differing by at
    most one (the first runs take the extra items). Consecutive, so that a group's trajectories, which a batch holds
    together, mostly land in one run and still share their prompt there."""
    if not 1 <= updates <= len(items):
        raise ValueError(f"cannot split a batch of {len(items)} trajectories into {updates} updates")
    size, extra = divmod(len(items), updates)
    bounds = [0]
    for index in range(updates):
        bounds.append(bounds[-1] + size + (1 if index < extra else 0))
    return [list(items[start:end]) for start, end in zip(bounds, bounds[1:])]


def rank_share(micro_batches: int, world: int, rank: int) -> list[tuple[int, float]]:
    """(micro-batch index, loss weight) that `rank` of `world` trains: its round-robin share,
    padded with a weight-0 repeat so that every rank runs ceil(micro_batches / world) backward
    passes (a gradient all-reduce needs every rank). One process (world 1) trains them all."""
    if micro_batches <= 0:
        raise ValueError("a step needs at least one micro-batch")
    passes = math.ceil(micro_batches / world)
    own = [(i, 1.0) for i in range(rank, micro_batches, world)]
    filler = own[0][0] if own else 0
    return own + [(filler, 0.0)] * (passes - len(own))
