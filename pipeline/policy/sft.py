"""Supervised warm-start of a policy on oracle demonstrations, and its success rate by real rollouts.

ARCHITECTURE.md "CPU machines and vLLM": the default policy is made here, so RL would start from a
policy that never completes a task (no reward signal, and a random model's sampled ids are rarely
the tokenizer's own encoding of their text, which the agent loop ends as agent_validation_failed).
`sft` fixes that:

1. demonstrations from each family's golden policy on its train split (SftSettings.train_splits: TRAIN_SPLITS
   unless a run names e.g. the easy tiers; pipeline/policy/demonstrations.py);
2. AdamW on token-mean cross-entropy over the assistant tokens only, one optimizer step per batch
   of demonstrations of one family, micro-batches packed by a token budget (learner.microbatch),
   the family's shared prompt prefix run once per micro-batch (learner/loss.py `next_token_logits`: same loss and
   gradients, measured 3.6x faster on 8 calc and 6x on 8 kg demonstrations), linear warm-up then
   cosine decay;
3. a servable Hugging Face checkpoint: the source's non-weight files (tokenizer, chat template)
   copied, config, generation config and safetensors written by transformers;
4. `evaluate`: one real engine (`rollstream engine`, vLLM) on the new checkpoint and the real
   agent loop over held-out samples (no Kafka), at the rollout temperature.

Nothing here depends on our tokenizer: a Qwen2.5 checkpoint directory goes through the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from env_workers.agent_loop import Rollout, run_agent_loop
from env_workers.chat_template import ChatEncoder
from env_workers.engines import EnginePool
from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.settings import AgentLoopSettings
from learner.loss import next_token_logits
from learner.microbatch import BatchItem, MicroBatch, make_micro_batches, shared_prefix_length
from pipeline.policy.demonstrations import Demonstration
from pipeline.policy.splits import EVAL_SPLITS, TRAIN_SPLITS
from pipeline.engine.launch import EngineProcess, launch_engine
from pipeline.analysis.evaluation import is_success
from schemas.ids import group_id, trajectory_id
from schemas.precision import Precision, cpu_dtype, host_cpu_flags

REPO_ROOT = Path(__file__).resolve().parents[2]
# Files of a checkpoint that hold weights: everything else (tokenizer, template, ...) is copied as is.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class SftSettings(BaseModel):
    """Supervised warm-start (not in the AgentRL paper, which starts from Qwen2.5-Instruct; sized for 2 CPU cores)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    families: tuple[str, ...] = ("calc", "os", "db")
    """Families to learn from: `make run`'s mix (issue 7: at least three, with os and db)."""
    samples: dict[str, int] = {"calc": 5000, "os": 48, "db": 48}
    """Train-split samples per family whose oracle episode becomes a demonstration. Nearly all go to calc,
    the one family a model this size was measured to learn: it picks the operation at once, but copies
    operands and tool results only after ~500 steps (held-out calc success at T 0.8, calc-only runs of
    batch 8 at lr 1e-3: 3% at 700 steps, 20% at 850, 19% at 1000, 33% at 1250, 64 episodes each). os and
    db are in at a few each so their tool-call format is seen."""
    epochs: int = Field(6, ge=1)
    """Passes over the demonstrations (3,822 steps with the default samples, ~45 minutes on two cores).
    Copying operands appears abruptly, at a step that depends on the seed, or not at all. Held-out calc of
    three operations (docs/RESULTS.md, 2026-12-04; 64 episodes at T 0.8) along one 6-epoch schedule: seed 0
    0% at 1,200 steps, 6% at 1,600, 34% at 2,000, 58% at 2,400, 69% at the end; seed 1 31% at 1,200, 58% at
    1,600, 98% at the end; seed 2 0% at 2,400, 3% at the end. Three epochs (1,911 steps, the former default,
    its cosine near its floor where copying starts for seeds 0 and 1) gave 78% on 1-3 operations on
    2026-11-30 and 0-3% on three operations twice on 2026-12-03. os and db stay at 0% either way."""
    batch_size: int = Field(8, ge=1)
    """Demonstrations per optimizer step, all of one family."""
    lr: float = Field(1e-3, gt=0.0)
    """Peak AdamW learning rate (a from-scratch model; the paper's RL lr 1e-6 is for a pretrained 14B). Measured
    on calc (batch 8): at 3e-3 the model never learns to copy operands (loss flat at 0.19 for 1,700 steps on
    one-operation tasks); at 1e-3 it does after ~300 steps there, ~500 on the default tasks."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps, then cosine decay to min_lr_ratio of the peak."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final learning rate as a share of the peak."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip."""
    compute_dtype: Precision = "float32"
    """What the forward and backward passes compute in (schemas/precision.py; bfloat16 is torch autocast, the weights
    and AdamW's state stay float32). float32 by default: at the default policy's size bfloat16 was no faster (30
    calc steps 10.45 s against 10.14 s, docs/BENCHMARKS.md "bench precision"), and the recipe above was measured in
    float32, where whether a model this size learns to copy operands depends on the arithmetic's order (seed 2,
    docs/RESULTS.md)."""
    max_tokens_per_micro_batch: int = Field(65536, ge=1)
    """Token budget of one micro-batch (rows x longest row), as the learner packs its batches; 12 kg rows
    (about 1.6 GB of attention activations: the shared prefix costs once, its attention once per row)."""
    seed: int = 0
    """Seed of the demonstration order."""
    train_splits: dict[str, str] = dict(TRAIN_SPLITS)
    """Split each family's demonstrations come from (the first `samples` of it), FAMILY: SPLIT; a family not
    named keeps TRAIN_SPLITS' (e.g. {"db": "easy-train"} for a run on the easy tiers, env_workers/envs/README.md)."""

    @field_validator("train_splits", mode="after")
    @classmethod
    def _over_the_defaults(cls, splits: dict[str, str]) -> dict[str, str]:
        return {**TRAIN_SPLITS, **splits}

    @model_validator(mode="after")
    def _every_family_has_a_count(self) -> SftSettings:
        missing = [name for name in self.families if self.samples.get(name, 0) < 1]
        if missing:
            raise ValueError(f"no sample count (>= 1) for {', '.join(missing)}")
        return self


class EvalSettings(BaseModel):
    """Per-family success rate by real rollouts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    episodes: int = Field(32, ge=0)
    """Held-out samples per family (the first ones of its eval split); 0 skips the evaluation."""
    concurrency: int = Field(16, ge=1)
    """Agent loops in flight against the engine."""
    agent_loop: AgentLoopSettings = AgentLoopSettings(max_new_tokens=256)
    """AgentRL loop limits and temperature 0.8; 256 new tokens per turn (a demonstrated turn is under 200)."""
    engine_start_timeout_s: float = Field(600.0, gt=0.0)
    """How long the engine may take to serve (30-80 s on 2 CPU cores)."""
    splits: dict[str, str] = dict(EVAL_SPLITS)
    """Held-out split each family's success is measured on, FAMILY: SPLIT; a family not named keeps EVAL_SPLITS'."""

    @field_validator("splits", mode="after")
    @classmethod
    def _over_the_defaults(cls, splits: dict[str, str]) -> dict[str, str]:
        return {**EVAL_SPLITS, **splits}


# --- training ----------------------------------------------------------------------------------


def lr_at(step: int, total_steps: int, settings: SftSettings) -> float:
    """Learning rate of optimizer step `step` (0-based): 1) linear warm-up, 2) cosine to min_lr_ratio."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return settings.lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


def batches(families: Sequence[str], settings: SftSettings, rng: np.random.Generator) -> list[list[int]]:
    """Demonstration indices of every optimizer step, given each demonstration's family.

    Each epoch, every family's demonstrations in a fresh order are cut into batch_size steps, and
    the steps of all families are shuffled together. One family per step: its demonstrations
    share the family's prompt prefix, which `next_token_logits` then runs once per step, not once per
    family per step (the prefix is most of the cost).
    """
    members: dict[str, list[int]] = {}
    for index, family in enumerate(families):
        members.setdefault(family, []).append(index)
    steps: list[list[int]] = []
    for _ in range(settings.epochs):
        epoch = [[indices[i] for i in order[start:start + settings.batch_size]]
                 for indices in members.values()
                 for order in [rng.permutation(len(indices)).tolist()]
                 for start in range(0, len(indices), settings.batch_size)]
        steps += [epoch[i] for i in rng.permutation(len(epoch)).tolist()]
    return steps


def masked_token_losses(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next token (B, T-1), zero where loss_mask is 0 (prompt, environment, padding);
    `logits` are learner/loss.py next_token_logits' (B, T-1, V): position t predicts token t+1."""
    losses = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
    return losses * loss_mask


def micro_batches(demos: Sequence[Demonstration], settings: SftSettings, pad_token_id: int) -> list[MicroBatch]:
    """Each family's demonstrations packed apart (they share that family's prompt prefix), by the token budget."""
    families: dict[str, list[BatchItem]] = {}
    for d in demos:
        families.setdefault(d.family, []).append(
            (np.asarray(d.input_ids), np.asarray(d.loss_mask), np.zeros(len(d.input_ids)), 0.0))
    return [micro for items in families.values()
            for micro in make_micro_batches(items, settings.max_tokens_per_micro_batch, pad_token_id)]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, demos: Sequence[Demonstration],
               lr: float, settings: SftSettings, pad_token_id: int) -> float:
    """One optimizer step on `demos`: token-mean loss over all their assistant tokens; returns that loss."""
    targets = sum(d.target_tokens for d in demos)
    dtype = cpu_dtype(settings.compute_dtype, host_cpu_flags())  # model sft trains on the CPU
    total = 0.0
    for micro in micro_batches(demos, settings, pad_token_id):
        # A family's system prompt and tool schemas, spelled byte by byte, are 1,400-4,700 of a demonstration's
        # 1,700-5,100 tokens: run once per micro-batch (learner/loss.py next_token_logits).
        prefix_len = shared_prefix_length(micro)
        ids = torch.from_numpy(micro.input_ids)  # (B, T)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = next_token_logits(model, ids, torch.from_numpy(micro.attention_mask), 1.0, prefix_len)  # (B, T-1-P, V)
        loss_sum = masked_token_losses(logits, ids[:, prefix_len:],
                                       torch.from_numpy(micro.loss_mask[:, prefix_len:])).sum()
        (loss_sum / targets).backward()  # gradients accumulate to the batch's token mean
        total += loss_sum.item()  # a sync point; only once per micro-batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / targets


def train(model: torch.nn.Module, demos: Sequence[Demonstration], settings: SftSettings, pad_token_id: int,
          rng: np.random.Generator, on_step: Callable[[int, float], None] = lambda step, loss: None) -> list[float]:
    """Fine-tunes `model` in place; the loss of every optimizer step, in order."""
    plan = batches([d.family for d in demos], settings, rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    model.train()
    losses = []
    for step, indices in enumerate(plan):
        losses.append(train_step(model, optimizer, [demos[i] for i in indices], lr_at(step, len(plan), settings),
                                 settings, pad_token_id))
        on_step(step, losses[-1])
    model.eval()
    return losses


def save_checkpoint(model: Any, source: Path, out: Path) -> None:
    """A servable checkpoint in `out`: `source`'s non-weight files, then config, generation config and safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
    model.save_pretrained(out, safe_serialization=True)


# --- evaluation by real rollouts ---------------------------------------------------------------


def eval_task(run: str, family: str, split: str, index: int) -> dict[str, Any]:
    """A `tasks` event (schemas/avro) for one validation rollout, on the current pool only."""
    request = {"run": run, "group_id": group_id(run, family, split, index, 0), "member": 0, "group_size": 1,
               "task": family, "split": split, "sample_index": index, "epoch": 0, "validation": True,
               "policy_version": 0, "dispatched_at_ms": 0}
    return {"request": request, "turn_pools": []}


@contextlib.contextmanager
def serving(model_dir: Path, work_dir: Path, max_model_len: int, start_timeout_s: float) -> Iterator[EngineProcess]:
    """One real `rollstream engine` on `model_dir` for the duration of the block (no weights to follow)."""
    engine = launch_engine(pool="current", model_dir=model_dir, run=f"sft-{uuid.uuid4().hex[:8]}",
                           work_dir=work_dir, extra_args=("--max-model-len", str(max_model_len)), cwd=REPO_ROOT)
    try:
        engine.wait_until_serving(start_timeout_s)
        yield engine
    finally:
        engine.stop()


async def roll_out(url: str, model_name: str, encoder: ChatEncoder, tasks: Sequence[Mapping[str, Any]],
                   loop_settings: AgentLoopSettings, env_settings: EnvSettings, concurrency: int,
                   on_done: Callable[[Rollout], None] = lambda rollout: None) -> list[Rollout]:
    """Runs the agent loop on every task against one engine, `concurrency` at a time, as an env worker does."""
    engines = EnginePool(stop_token_ids=[encoder.eos_token_id], clock_ms=lambda: int(time.time() * 1000),
                         heartbeat_timeout_s=60.0, failure_backoff_s=1.0, timeout_s=loop_settings.engine_timeout_s)
    engines.add_static({"current": [url]}, model_name)
    envs = {family: registry.environment(family, env_settings) for family in {t["request"]["task"] for t in tasks}}
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Mapping[str, Any]) -> Rollout:
        request = task["request"]
        sample = registry.sample(request["task"], request["split"], request["sample_index"], env_settings)
        async with gate:
            pick = engines.for_trajectory(trajectory_id(request["run"], request["group_id"], request["member"]), False)
            rollout = await run_agent_loop(task, sample, envs[request["task"]], encoder, pick, loop_settings,
                                           worker_id="sft-eval", clock=time.time)
        on_done(rollout)
        return rollout

    try:
        return list(await asyncio.gather(*(one(task) for task in tasks)))
    finally:
        await engines.aclose()


def success_table(trajectories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per family: episodes, success rate (completed with full credit), mean trajectory reward, status shares."""
    rows = []
    for family in sorted({t["task"] for t in trajectories}):
        mine = [t for t in trajectories if t["task"] == family]
        statuses: dict[str, float] = {}
        for t in mine:
            statuses[t["status"]] = statuses.get(t["status"], 0.0) + 1.0 / len(mine)
        successes = sum(is_success(t) for t in mine)
        rows.append({"family": family, "episodes": len(mine), "success_rate": successes / len(mine),
                     "mean_reward": float(np.mean([t["reward"] for t in mine])),
                     "statuses": dict(sorted(statuses.items(), key=lambda item: -item[1]))})
    return rows
