"""`rollstream model sft` once its options are checked: oracle demonstrations of each family's train
split, fine-tuning on them (pipeline/policy/sft.py), and the new checkpoint's success by real
rollouts against one engine serving it."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import served_model
from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from pipeline.policy.demonstrations import Demonstration, demonstrations
from pipeline.policy.sft import (
    EvalSettings,
    SftSettings,
    eval_task,
    roll_out,
    save_checkpoint,
    serving,
    success_table,
    train,
)
from schemas.precision import cpu_dtype, host_cpu_flags


def progress_bar(total: int, desc: str, unit: str, quiet: bool) -> tqdm:
    """A progress bar on stderr. Written to a log rather than a terminal (`rollstream up` making the policy
    with its output redirected) it still reports, every 30 s, so that minutes of SFT are not silent."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet,
                mininterval=0.1 if sys.stderr.isatty() else 30.0)


def loss_window(losses: list[float]) -> tuple[float, float]:
    """Mean loss of the first and of the last tenth of the steps (single steps are noisy)."""
    window = max(1, len(losses) // 10)
    return float(np.mean(losses[:window])), float(np.mean(losses[-window:]))


def collect_demonstrations(settings: SftSettings, envs: EnvSettings, encoder: ChatEncoder,
                           quiet: bool = True) -> tuple[list[Demonstration], dict[str, dict[str, Any]]]:
    """Oracle episodes of each family's SFT split (settings.train_splits), tokenized as the agent loop records them, and per
    family what was built. Raises registry.UnknownFamily, DemonstrationError or FileNotFoundError."""
    demos: list[Demonstration] = []
    built: dict[str, dict[str, Any]] = {}
    for name in settings.families:
        pool = registry.samples(name, settings.train_splits[name], envs)[:settings.samples[name]]
        bar = progress_bar(len(pool), f"demonstrations {name}", "episode", quiet)
        found, failed = asyncio.run(demonstrations(name, registry.environment(name, envs), pool,
                                                   registry.family(name).golden, encoder, bar.update))
        bar.close()
        demos += found
        built[name] = {"split": settings.train_splits[name], "demonstrations": len(found), "oracle_failures": failed,
                       "mean_tokens": float(np.mean([len(d.input_ids) for d in found])) if found else 0.0,
                       "mean_target_tokens": float(np.mean([d.target_tokens for d in found])) if found else 0.0}
    return demos, built


def checkpoint_dir(out: Path, step: int) -> Path:
    """Where `fine_tune(checkpoint_every=...)` writes the checkpoint after `step` optimizer steps."""
    return out / "steps" / f"{step:06d}"


def fine_tune(model: Path, out: Path, demos: list[Demonstration], settings: SftSettings, pad: int,
              quiet: bool, checkpoint_every: int = 0) -> dict[str, Any]:
    """Fine-tunes `model` on `demos` in float32 (the CPU engine serves float32), writes the checkpoint to
    `out`, and returns the training's part of the report. With `checkpoint_every` N > 0 it also writes a
    servable checkpoint after every N optimizer steps (`checkpoint_dir`), so that one run can be evaluated
    at several points of its schedule (`rollstream model eval`)."""
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    per_family = Counter(d.family for d in demos).values()
    steps = settings.epochs * sum(-(-count // settings.batch_size) for count in per_family)
    bar = progress_bar(steps, "sft", "step", quiet)

    written: list[dict[str, Any]] = []
    recent: list[float] = []

    def on_step(step: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # refresh=True would redraw every step, ignoring mininterval
        bar.update()
        recent.append(loss)
        if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            save_checkpoint(policy, model, checkpoint_dir(out, step + 1))
            written.append({"step": step + 1, "path": str(checkpoint_dir(out, step + 1)),
                            "loss": float(np.mean(recent[-checkpoint_every:]))})

    started = time.perf_counter()
    losses = train(policy, demos, settings, pad, np.random.default_rng(settings.seed), on_step)
    bar.close()
    train_s = time.perf_counter() - started
    save_checkpoint(policy, model, out)
    first, last = loss_window(losses)
    return {"steps": len(losses), "epochs": settings.epochs, "batch_size": settings.batch_size, "lr": settings.lr,
            "compute_dtype": cpu_dtype(settings.compute_dtype, host_cpu_flags()),
            "first_loss": first, "last_loss": last, "train_s": round(train_s, 2),
            **({"checkpoints": written} if checkpoint_every else {})}


def evaluate(out: Path, names: tuple[str, ...], evaluation: EvalSettings, encoder: ChatEncoder, envs: EnvSettings,
             quiet: bool) -> dict[str, Any]:
    """Per-family success of the fine-tuned checkpoint, by real rollouts against one engine serving it.
    Raises RuntimeError when the engine does not come up."""
    loop = evaluation.agent_loop
    splits = evaluation.splits
    tasks = [eval_task("sft-eval", name, splits[name], index)
             for name in names for index in range(min(evaluation.episodes, len(registry.samples(name, splits[name], envs))))]
    with tempfile.TemporaryDirectory(prefix="rollstream-sft-engine-") as work:
        engine_started = time.perf_counter()
        with serving(out, Path(work), loop.max_total_len, evaluation.engine_start_timeout_s) as engine:
            engine_s = time.perf_counter() - engine_started
            bar = progress_bar(len(tasks), "eval rollouts", "traj", quiet)
            eval_started = time.perf_counter()
            rollouts = asyncio.run(roll_out(engine.url, served_model(engine.url), encoder, tasks, loop, envs,
                                            evaluation.concurrency, lambda rollout: bar.update()))
            eval_s = time.perf_counter() - eval_started
            bar.close()
    trajectories = [r.trajectory for r in rollouts]
    return {"temperature": loop.temperature, "episodes_per_family": evaluation.episodes,
            "max_new_tokens": loop.max_new_tokens, "split": {name: splits[name] for name in names},
            "engine_start_s": round(engine_s, 2), "eval_s": round(eval_s, 2),
            "table": success_table(trajectories)}
