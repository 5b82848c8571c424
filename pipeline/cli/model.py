"""`rollstream model`: the default policy checkpoint.

Register in pipeline/cli/__init__.py with `app.add_typer(model_cmd.app, name="model")`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import served_model
from env_workers.envs import registry
from pipeline.policy.demonstrations import DemonstrationError, demonstrations
from pipeline.policy.model_init import PolicyModelSettings, init_model
from pipeline.policy.sft import (
    EVAL_SPLITS,
    TRAIN_SPLITS,
    EvalSettings,
    SftSettings,
    eval_task,
    roll_out,
    save_checkpoint,
    serving,
    success_table,
    train,
)
from pipeline.run.config import load_config

app = typer.Typer(help="The default policy model.", no_args_is_help=True)


@app.callback()
def model() -> None:
    """The default policy model: `model init` creates it, `model sft` warm-starts it."""


@app.command("init")
def init(
    out: Path = typer.Option(..., "--out", help="Directory to write the checkpoint to."),
    hidden: int = typer.Option(PolicyModelSettings().hidden_size, "--hidden", help="Hidden size (64 per head)."),
    layers: int = typer.Option(PolicyModelSettings().num_layers, "--layers", help="Transformer blocks."),
    heads: int = typer.Option(PolicyModelSettings().num_heads, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(PolicyModelSettings().num_kv_heads, "--kv-heads", help="Key/value heads."),
    intermediate: int = typer.Option(PolicyModelSettings().intermediate_size, "--intermediate", help="MLP width."),
    seed: int = typer.Option(PolicyModelSettings().seed, "--seed", help="Initialization seed."),
    vocab_size: int = typer.Option(PolicyModelSettings().vocab_size, "--vocab-size",
                                   help="Byte-level BPE vocabulary, merges learned from oracle episodes (256: bytes only)."),
    force: bool = typer.Option(False, "--force", help="Write into a directory that is not empty."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Create the default policy: a small Qwen2 model with a byte-level BPE tokenizer and a tool-call chat template.

    The tokenizer's merges are learned from the environments' oracle episodes (train splits; about
    15 s), unless --vocab-size 256.

    Example: rollstream model init --out .run/policy --json
    """
    try:
        settings = PolicyModelSettings(hidden_size=hidden, num_layers=layers, num_heads=heads,
                                       num_kv_heads=kv_heads, intermediate_size=intermediate, seed=seed,
                                       vocab_size=vocab_size)
    except ValidationError as error:
        typer.echo(f"rollstream model init: {error.errors()[0]['msg']}", err=True)
        raise typer.Exit(code=2) from None
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        typer.echo(f"rollstream model init: {out} exists and is not an empty directory (use --force)", err=True)
        raise typer.Exit(code=2)
    summary = init_model(settings, out)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"wrote {summary['parameters']:,}-parameter policy to {out} "
                   f"(vocab {summary['vocab_size']}, {summary['merges']} merges, hidden {hidden}, {layers} layers, "
                   f"seed {seed})")


def _sft_fail(message: str) -> NoReturn:
    typer.echo(f"rollstream model sft: {message}", err=True)
    raise typer.Exit(code=2)


def _sample_counts(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """`--samples`: one count for every family, or NAME=N pairs naming every family trained."""
    try:
        if "=" not in text:
            counts = dict.fromkeys(names, int(text))
        else:
            counts = {name: int(count) for name, count in (pair.split("=") for pair in text.split(",") if pair)}
    except ValueError:
        _sft_fail(f"--samples: expected N or NAME=N,..., got {text!r}")
    missing = [name for name in names if name not in counts]
    if missing:
        _sft_fail(f"--samples names no count for {', '.join(missing)}")
    if any(counts[name] < 1 for name in names):
        _sft_fail("--samples: every count must be at least 1")
    return {name: counts[name] for name in names}


def _progress(total: int, desc: str, unit: str, quiet: bool) -> tqdm:
    """A progress bar on stderr. Written to a log rather than a terminal (`rollstream up` making the policy
    with its output redirected) it still reports, every 30 s, so that minutes of SFT are not silent."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet,
                mininterval=0.1 if sys.stderr.isatty() else 30.0)


def _loss_window(losses: list[float]) -> tuple[float, float]:
    """Mean loss of the first and of the last tenth of the steps (single steps are noisy)."""
    window = max(1, len(losses) // 10)
    return float(np.mean(losses[:window])), float(np.mean(losses[-window:]))


@app.command("sft")
def sft(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory to fine-tune (ours or e.g. Qwen2.5)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the fine-tuned checkpoint to."),
    families: str = typer.Option(",".join(SftSettings().families), "--families", help="Comma-separated families."),
    samples: str = typer.Option(",".join(f"{k}={v}" for k, v in SftSettings().samples.items()), "--samples",
                                help="Train samples per family: N for every family, or NAME=N,..."),
    epochs: int = typer.Option(SftSettings().epochs, "--epochs", help="Passes over the demonstrations."),
    batch_size: int = typer.Option(SftSettings().batch_size, "--batch-size", help="Demonstrations per step."),
    lr: float = typer.Option(SftSettings().lr, "--lr", help="Peak learning rate."),
    micro_tokens: int = typer.Option(SftSettings().max_tokens_per_micro_batch, "--micro-batch-tokens",
                                     help="Token budget of one micro-batch."),
    seed: int = typer.Option(SftSettings().seed, "--seed", help="Seed of the demonstration order."),
    eval_episodes: int = typer.Option(EvalSettings().episodes, "--eval-episodes",
                                      help="Held-out rollouts per family (0: no evaluation)."),
    config: Path | None = typer.Option(None, "--config", help="YAML run configuration whose task environments "
                                       "(`envs`: data, calc difficulty, sandbox) demonstrations and evaluation use."),
    force: bool = typer.Option(False, "--force", help="Write into a directory that is not empty."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Fine-tune a policy on oracle demonstrations (assistant tokens only), then measure each family's
    success rate by real rollouts against a vLLM engine serving the new checkpoint (temperature 0.8).

    Example: rollstream model sft --model .run/policy --out .run/policy-sft --families calc --json
    """
    names = tuple(name for name in families.split(",") if name)
    unknown = [name for name in names if name not in TRAIN_SPLITS]
    if not names or unknown:
        _sft_fail(f"unknown families {unknown or families!r}; known: {', '.join(TRAIN_SPLITS)}")
    if not (model / "config.json").is_file() or not (model / "tokenizer_config.json").is_file():
        _sft_fail(f"{model} is not a checkpoint directory (config.json and tokenizer_config.json)")
    if out.resolve() == model.resolve():
        _sft_fail("--out must differ from --model")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        _sft_fail(f"{out} exists and is not an empty directory (use --force)")
    counts = _sample_counts(samples, names)
    try:
        settings = SftSettings(families=names, samples=counts, epochs=epochs, batch_size=batch_size, lr=lr,
                               max_tokens_per_micro_batch=micro_tokens, seed=seed)
        evaluation = EvalSettings(episodes=eval_episodes)
    except ValidationError as error:
        _sft_fail(f"{error.errors()[0]['loc'][0]}: {error.errors()[0]['msg']}")
    started = time.perf_counter()
    try:
        envs = load_config(config).envs
    except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        _sft_fail(f"--config {config}: {error}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        encoder = ChatEncoder(tokenizer)
    except ValueError as error:
        _sft_fail(f"{model}: {error}")

    # Demonstrations: oracle episodes of each family's train split, tokenized as the agent loop records them.
    demos, built = [], {}
    try:
        for name in names:
            pool = registry.samples(name, TRAIN_SPLITS[name], envs)[:settings.samples[name]]
            found, failed = asyncio.run(demonstrations(name, registry.environment(name, envs), pool,
                                                       registry.family(name).golden, encoder))
            demos += found
            built[name] = {"demonstrations": len(found), "oracle_failures": failed,
                           "mean_tokens": float(np.mean([len(d.input_ids) for d in found])) if found else 0.0,
                           "mean_target_tokens": float(np.mean([d.target_tokens for d in found])) if found else 0.0}
    except (registry.UnknownFamily, DemonstrationError, FileNotFoundError) as error:
        _sft_fail(str(error))
    if not demos:
        _sft_fail("no oracle episode succeeded: nothing to learn from")
    demos_s = time.perf_counter() - started

    # Fine-tuning, in float32 (the CPU engine serves float32).
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else encoder.eos_token_id
    per_family = Counter(d.family for d in demos).values()
    steps = settings.epochs * sum(-(-count // settings.batch_size) for count in per_family)
    bar = _progress(steps, "sft", "step", quiet)

    def on_step(step: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # refresh=True would redraw every step, ignoring mininterval
        bar.update()

    train_started = time.perf_counter()
    losses = train(policy, demos, settings, pad, np.random.default_rng(settings.seed), on_step)
    bar.close()
    train_s = time.perf_counter() - train_started
    save_checkpoint(policy, model, out)
    first, last = _loss_window(losses)
    report: dict[str, Any] = {
        "model": str(model), "out": str(out), "families": built, "demonstrations": len(demos),
        "steps": len(losses), "epochs": settings.epochs, "batch_size": settings.batch_size, "lr": settings.lr,
        "first_loss": first, "last_loss": last, "demonstrations_s": round(demos_s, 2), "train_s": round(train_s, 2),
    }
    if evaluation.episodes:
        try:
            report["eval"] = _evaluate(out, names, evaluation, encoder, envs, quiet)
        except RuntimeError as error:  # the engine did not come up: the checkpoint is written, say why
            typer.echo(f"rollstream model sft: wrote {out}, but its evaluation failed: {error}", err=True)
            raise typer.Exit(code=1) from None
    report["total_s"] = round(time.perf_counter() - started, 2)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_report(report)


def _evaluate(out: Path, names: tuple[str, ...], evaluation: EvalSettings, encoder: ChatEncoder, envs: Any,
              quiet: bool) -> dict[str, Any]:
    """Per-family success of the fine-tuned checkpoint, by real rollouts against one engine serving it."""
    loop = evaluation.agent_loop
    tasks = [eval_task("sft-eval", name, EVAL_SPLITS[name], index)
             for name in names for index in range(min(evaluation.episodes, len(registry.samples(name, EVAL_SPLITS[name], envs))))]
    with tempfile.TemporaryDirectory(prefix="rollstream-sft-engine-") as work:
        engine_started = time.perf_counter()
        with serving(out, Path(work), loop.max_total_len, evaluation.engine_start_timeout_s) as engine:
            engine_s = time.perf_counter() - engine_started
            bar = _progress(len(tasks), "eval rollouts", "traj", quiet)
            eval_started = time.perf_counter()
            rollouts = asyncio.run(roll_out(engine.url, served_model(engine.url), encoder, tasks, loop, envs,
                                            evaluation.concurrency, lambda rollout: bar.update()))
            eval_s = time.perf_counter() - eval_started
            bar.close()
    trajectories = [r.trajectory for r in rollouts]
    return {"temperature": loop.temperature, "episodes_per_family": evaluation.episodes,
            "max_new_tokens": loop.max_new_tokens, "split": {name: EVAL_SPLITS[name] for name in names},
            "engine_start_s": round(engine_s, 2), "eval_s": round(eval_s, 2),
            "table": success_table(trajectories)}


def _print_report(report: dict[str, Any]) -> None:
    console = Console()
    console.print(f"{report['demonstrations']} demonstrations, {report['steps']} steps in {report['train_s']:.0f} s: "
                  f"loss {report['first_loss']:.3f} -> {report['last_loss']:.3f}; checkpoint in {report['out']}")
    evaluation = report.get("eval")
    if evaluation:
        table = Table(title=f"success by real rollouts ({evaluation['episodes_per_family']} held-out episodes per "
                            f"family, temperature {evaluation['temperature']})")
        for column in ("family", "episodes", "success rate", "mean reward", "statuses"):
            table.add_column(column)
        for row in evaluation["table"]:
            table.add_row(row["family"], str(row["episodes"]), f"{row['success_rate']:.0%}", f"{row['mean_reward']:.3f}",
                          ", ".join(f"{k} {v:.0%}" for k, v in row["statuses"].items()))
        console.print(table)
    console.print(f"total {report['total_s']:.0f} s")
