"""`rollstream model`: the default policy checkpoint.

Register in pipeline/cli.py with `app.add_typer(model_cmd.app, name="model")`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError

from pipeline.model_init import PolicyModelSettings, init_model

app = typer.Typer(help="The default policy model.", no_args_is_help=True)


@app.callback()
def model() -> None:
    """The default policy model (a group: `model sft` joins `model init` later)."""


@app.command("init")
def init(
    out: Path = typer.Option(..., "--out", help="Directory to write the checkpoint to."),
    hidden: int = typer.Option(PolicyModelSettings().hidden_size, "--hidden", help="Hidden size (64 per head)."),
    layers: int = typer.Option(PolicyModelSettings().num_layers, "--layers", help="Transformer blocks."),
    heads: int = typer.Option(PolicyModelSettings().num_heads, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(PolicyModelSettings().num_kv_heads, "--kv-heads", help="Key/value heads."),
    intermediate: int = typer.Option(PolicyModelSettings().intermediate_size, "--intermediate", help="MLP width."),
    seed: int = typer.Option(PolicyModelSettings().seed, "--seed", help="Initialization seed."),
    force: bool = typer.Option(False, "--force", help="Write into a directory that is not empty."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Create the default policy: a small Qwen2 model with a byte-level tokenizer and a tool-call chat template.

    Example: rollstream model init --out .run/policy --json
    """
    try:
        settings = PolicyModelSettings(hidden_size=hidden, num_layers=layers, num_heads=heads,
                                       num_kv_heads=kv_heads, intermediate_size=intermediate, seed=seed)
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
                   f"(vocab {summary['vocab_size']}, hidden {hidden}, {layers} layers, seed {seed})")
