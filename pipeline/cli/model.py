"""`rollstream model`: the default policy checkpoint (pipeline/policy/model_init.py, warm_start.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.envs import registry
from pipeline.cli.toolkit import CHECK_FAILED, App, ConfigOption, JsonOption, QuietOption, fail
from pipeline.policy.demonstrations import DemonstrationError, split_error
from pipeline.policy.model_init import PolicyModelSettings, init_model
from pipeline.policy.sft import TRAIN_SPLITS, EvalSettings, SftSettings
from pipeline.policy.warm_start import collect_demonstrations, evaluate, fine_tune
from pipeline.run.config import load_config

EvalSplitOption = Annotated[list[str], typer.Option(
    "--eval-split", help="FAMILY=SPLIT the family's success is measured on (repeatable). Default: " +
    ", ".join(f"{k}={v}" for k, v in EvalSettings().splits.items()))]

app = App(name="model", help="The default policy model.", no_args_is_help=True)


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
    as_json: JsonOption = False,
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
        fail(error.errors()[0]["msg"])
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        fail(f"{out} exists and is not an empty directory (use --force)")
    summary = init_model(settings, out)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"wrote {summary['parameters']:,}-parameter policy to {out} "
                   f"(vocab {summary['vocab_size']}, {summary['merges']} merges, hidden {hidden}, {layers} layers, "
                   f"seed {seed})")


@app.command("ensure")
def ensure(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Make the configuration's policy (policy.path) as `rollstream up` does when it is missing: `model init`
    then `model sft` on the configuration's tasks. An existing checkpoint is left as it is. For a
    deployment's one-off job that runs before the engines and the learner (docker-compose.yml's `policy`).

    Example: rollstream model ensure --config configs/cpu.yaml --json
    """
    from pipeline.run.policy import ensure_policy
    from pipeline.run.supervision import RunFailed

    cfg = load_config(config)
    log_dir = cfg.policy_dir().parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    made = not (cfg.policy_dir() / "config.json").is_file()
    try:
        path = ensure_policy(cfg, log_dir, lambda line: typer.echo(line, err=True))
    except RunFailed as error:
        fail(str(error))
    if as_json:
        typer.echo(json.dumps({"policy": str(path), "made": made}))
    else:
        typer.echo(f"policy {path} ({'made' if made else 'already there'})")


def _sample_counts(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """`--samples`: one count for every family, or NAME=N pairs naming every family trained."""
    try:
        if "=" not in text:
            counts = dict.fromkeys(names, int(text))
        else:
            counts = {name: int(count) for name, count in (pair.split("=") for pair in text.split(",") if pair)}
    except ValueError:
        fail(f"--samples: expected N or NAME=N,..., got {text!r}")
    missing = [name for name in names if name not in counts]
    if missing:
        fail(f"--samples names no count for {', '.join(missing)}")
    if any(counts[name] < 1 for name in names):
        fail("--samples: every count must be at least 1")
    return {name: counts[name] for name in names}


def _family_splits(option: str, pairs: list[str], names: tuple[str, ...]) -> dict[str, str]:
    """`--split` / `--eval-split`: FAMILY=SPLIT pairs, each a family trained here and a split the registry has."""
    splits: dict[str, str] = {}
    for pair in pairs:
        family, _, split = pair.partition("=")
        if not family or not split:
            fail(f"{option}: expected FAMILY=SPLIT, got {pair!r}")
        splits[family] = split
    problem = split_error(splits)
    if problem:
        fail(f"{option}: {problem}")
    untrained = [family for family in splits if family not in names]
    if untrained:
        fail(f"{option} names {', '.join(untrained)}, which --families does not train")
    return splits


def _check_inputs(names: tuple[str, ...], families: str, model: Path) -> None:
    unknown = [name for name in names if name not in TRAIN_SPLITS]
    if not names or unknown:
        fail(f"unknown families {unknown or families!r}; known: {', '.join(TRAIN_SPLITS)}")
    if not (model / "config.json").is_file() or not (model / "tokenizer_config.json").is_file():
        fail(f"{model} is not a checkpoint directory (config.json and tokenizer_config.json)")


def _check_paths(names: tuple[str, ...], families: str, model: Path, out: Path, force: bool) -> None:
    _check_inputs(names, families, model)
    if out.resolve() == model.resolve():
        fail("--out must differ from --model")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        fail(f"{out} exists and is not an empty directory (use --force)")


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
    compute_dtype: str = typer.Option(SftSettings().compute_dtype, "--compute-dtype",
                                      help="float32, bfloat16 (autocast; weights stay float32) or auto (bfloat16 "
                                           "on a CPU with AMX-BF16 or AVX512-BF16)."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0,
                                         help="Also write a checkpoint after every N steps, to OUT/steps/NNNNNN "
                                              "(0: only the final one); `model eval` measures each."),
    eval_episodes: int = typer.Option(EvalSettings().episodes, "--eval-episodes",
                                      help="Held-out rollouts per family (0: no evaluation)."),
    split: list[str] = typer.Option([], "--split", help="FAMILY=SPLIT the family's demonstrations come from "
                                    "(repeatable; e.g. db=easy-train). Default: " +
                                    ", ".join(f"{k}={v}" for k, v in SftSettings().train_splits.items())),
    eval_split: EvalSplitOption = [],
    config: ConfigOption = None,
    force: bool = typer.Option(False, "--force", help="Write into a directory that is not empty."),
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Fine-tune a policy on oracle demonstrations (assistant tokens only), then measure each family's
    success rate by real rollouts against a vLLM engine serving the new checkpoint (temperature 0.8).
    The configuration's task environments (`envs`: data, calc difficulty, sandbox) give the
    demonstrations and the evaluation; --split and --eval-split choose other splits (e.g. the easy tiers).

    Example: rollstream model sft --model .run/policy --out .run/policy-sft --families db --split db=easy-train
    """
    envs = load_config(config).envs
    names = tuple(name for name in families.split(",") if name)
    _check_paths(names, families, model, out, force)
    counts = _sample_counts(samples, names)
    train_splits = _family_splits("--split", split, names)
    eval_splits = _family_splits("--eval-split", eval_split, names)
    try:
        settings = SftSettings(families=names, samples=counts, epochs=epochs, batch_size=batch_size, lr=lr,
                               max_tokens_per_micro_batch=micro_tokens, seed=seed, train_splits=train_splits,
                               compute_dtype=compute_dtype)
        evaluation = EvalSettings(episodes=eval_episodes, splits=eval_splits)
    except ValidationError as error:
        fail(f"{error.errors()[0]['loc'][0]}: {error.errors()[0]['msg']}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        encoder = ChatEncoder(tokenizer)
    except ValueError as error:
        fail(f"{model}: {error}")
    try:
        demos, built = collect_demonstrations(settings, envs, encoder, quiet)
    except (registry.UnknownFamily, DemonstrationError, FileNotFoundError) as error:
        fail(str(error))
    if not demos:
        fail("no oracle episode succeeded: nothing to learn from")
    demos_s = time.perf_counter() - started
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else encoder.eos_token_id
    report: dict[str, Any] = {"model": str(model), "out": str(out), "families": built, "demonstrations": len(demos),
                              **fine_tune(model, out, demos, settings, pad, quiet, checkpoint_every),
                              "demonstrations_s": round(demos_s, 2)}
    if evaluation.episodes:
        try:
            report["eval"] = evaluate(out, names, evaluation, encoder, envs, quiet)
        except RuntimeError as error:  # the engine did not come up: the checkpoint is written, say why
            fail(f"wrote {out}, but its evaluation failed: {error}", CHECK_FAILED)
    report["total_s"] = round(time.perf_counter() - started, 2)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_report(report)


@app.command("eval")
def eval_(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory to measure."),
    families: str = typer.Option(",".join(SftSettings().families), "--families", help="Comma-separated families."),
    eval_episodes: int = typer.Option(EvalSettings().episodes, "--eval-episodes", min=1,
                                      help="Held-out rollouts per family."),
    eval_split: EvalSplitOption = [],
    config: ConfigOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Measure a checkpoint's success per family by real rollouts against a vLLM engine serving it, as
    `model sft` does after training (same held-out samples, temperature 0.8); e.g. each of the
    checkpoints `model sft --checkpoint-every` wrote.

    Example: rollstream model eval --model .run/models/default --families calc --eval-episodes 64 --json
    """
    envs = load_config(config).envs
    names = tuple(name for name in families.split(",") if name)
    _check_inputs(names, families, model)
    evaluation = EvalSettings(episodes=eval_episodes, splits=_family_splits("--eval-split", eval_split, names))
    started = time.perf_counter()
    try:
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
    except ValueError as error:
        fail(f"{model}: {error}")
    try:
        result = evaluate(model, names, evaluation, encoder, envs, quiet)
    except RuntimeError as error:  # the engine did not come up
        fail(f"{model}: evaluation failed: {error}", CHECK_FAILED)
    report = {"model": str(model), "eval": result, "total_s": round(time.perf_counter() - started, 2)}
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_eval(Console(), result)
        Console().print(f"total {report['total_s']:.0f} s")


def _print_report(report: dict[str, Any]) -> None:
    console = Console()
    console.print(f"{report['demonstrations']} demonstrations, {report['steps']} steps in {report['train_s']:.0f} s: "
                  f"loss {report['first_loss']:.3f} -> {report['last_loss']:.3f}; checkpoint in {report['out']}")
    for checkpoint in report.get("checkpoints", []):
        console.print(f"  step {checkpoint['step']}: loss {checkpoint['loss']:.3f}, checkpoint in {checkpoint['path']}")
    evaluation = report.get("eval")
    if evaluation:
        _print_eval(console, evaluation)
    console.print(f"total {report['total_s']:.0f} s")


def _print_eval(console: Console, evaluation: dict[str, Any]) -> None:
    table = Table(title=f"success by real rollouts ({evaluation['episodes_per_family']} held-out episodes per "
                        f"family, temperature {evaluation['temperature']})")
    for column in ("family", "split", "episodes", "success rate", "mean reward", "statuses"):
        table.add_column(column)
    for row in evaluation["table"]:
        table.add_row(row["family"], evaluation["split"].get(row["family"], ""), str(row["episodes"]),
                      f"{row['success_rate']:.0%}", f"{row['mean_reward']:.3f}",
                      ", ".join(f"{k} {v:.0%}" for k, v in row["statuses"].items()))
    console.print(table)
