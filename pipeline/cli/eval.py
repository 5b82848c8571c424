"""`rollstream eval`: held-out success of one checkpoint, through the same pipeline as training
(pipeline/run/eval.py). Printed: per task the success rate as mean ± std over the n repeats
(AgentRL Table 3) and the termination-status shares (Table 7).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pipeline.cli.toolkit import CHECK_FAILED, INTERRUPTED, ConfigOption, JsonOption, fail
from pipeline.policy.loading import VersionUnavailable, materialize_version
from pipeline.run.config import RollstreamConfig, load_config
from pipeline.run.eval import STD, run_eval, validation_sources
from pipeline.run.up import Interrupted, RunFailed


def print_tables(result: dict, console: Console) -> None:
    success = Table(title=f"success, mean ± std over n = {result['n']}")
    for col in ("task", "episodes", "success"):
        success.add_column(col, justify="right")
    for task, row in result["success"].items():
        success.add_row(task, str(sum(row["episodes"])), f"{row['mean']:.1%} ± {row['std']:.1%}")
    console.print(success)
    shares = result["termination"]
    statuses = sorted({s for t in shares["tasks"].values() for s in t["shares"]})
    status_table = Table(title="termination status shares")
    status_table.add_column("task")
    for s in statuses:
        status_table.add_column(s.replace("_", " "), justify="right")
    for task, row in [*shares["tasks"].items(), ("overall", shares["overall"])]:
        status_table.add_row(task, *(f"{row['shares'].get(s, 0.0):.0%}" for s in statuses))
    console.print(status_table)


def eval_checkpoint(
    checkpoint: str = typer.Option(..., "--checkpoint", help="A checkpoint directory, or a VERSION of --run staged in MinIO."),
    run: str = typer.Option("", "--run", help="The training run whose VERSION to evaluate."),
    split: str = typer.Option(STD, "--split", help="'std' (each family's held-out split) or one split name for all."),
    n: int = typer.Option(4, "--n", min=1, help="Repeats of every sample (AgentRL: 4)."),
    families: str = typer.Option("", "--families", help="Comma-separated families (default: the configured validation families)."),
    samples: int | None = typer.Option(None, "--samples", min=1, help="Samples per family, the first ones (default: mix.val_samples)."),
    timeout_s: float = typer.Option(3600.0, "--timeout-s", help="Give up after this long."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Evaluate a checkpoint on held-out tasks through the pipeline (current pool only).

    Example: rollstream eval --checkpoint 20 --run run-20261129-120000 --split std --n 4 --config configs/cpu.yaml
    """
    cfg = load_config(config)
    console = Console(stderr=True)
    chosen = [f.strip() for f in families.split(",") if f.strip()] or [f.partition(":")[0] for f in cfg.mix.val_families]
    try:
        sources = validation_sources(chosen, split, samples or cfg.mix.val_samples, cfg.envs)
    except ValueError as error:
        fail(str(error))
    model_dir, version = _checkpoint(cfg, checkpoint, run)
    try:
        result = run_eval(cfg, model_dir, version, sources, n, console, timeout_s)
    except RunFailed as error:
        fail(str(error), CHECK_FAILED)
    except Interrupted:
        fail("interrupted", INTERRUPTED)
    result["checkpoint"] = str(model_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_tables(result, Console())


def _checkpoint(cfg: RollstreamConfig, checkpoint: str, run: str) -> tuple[Path, int]:
    """--checkpoint as a servable directory and its version: a directory as it is (version 0), or a
    VERSION of --run staged in the object store, materialized under the run's folder."""
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return path, 0
    if not checkpoint.isdigit():
        fail(f"--checkpoint {checkpoint!r} is neither a checkpoint directory (with config.json) nor a version number")
    if not run:
        fail("--checkpoint VERSION needs --run (the run that trained it)")
    base = cfg.policy_dir()
    if not (base / "config.json").is_file():
        fail(f"the policy {base} (policy.path) is needed for the tokenizer and config of version {checkpoint}")
    try:
        return materialize_version(cfg, run, int(checkpoint), base, cfg.run_dir(run) / "checkpoints"), int(checkpoint)
    except VersionUnavailable as error:
        fail(str(error), CHECK_FAILED)
