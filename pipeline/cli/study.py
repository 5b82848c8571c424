"""`rollstream study`: one configuration under N seeds and several variants (pipeline/run/study.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pipeline.analysis.study import table_rows
from pipeline.cli.toolkit import INTERRUPTED, ConfigOption, JsonOption, fail
from pipeline.run.config import load_config
from pipeline.run.study import VARIANTS, StudyExists, parse_variants, run_study
from pipeline.run.up import timestamped


def study(
    config: ConfigOption = None,
    seeds: int = typer.Option(..., "--seeds", min=1, help="How many seeds, each run under every variant."),
    first_seed: int = typer.Option(0, "--first-seed", min=0,
                                   help="The first seed: seeds FIRST..FIRST+N-1 (continues another study's seeds)."),
    variants: str = typer.Option("base", "--variants", help=f"Comma-separated variants: {', '.join(VARIANTS)}."),
    name: str = typer.Option("", "--study", help="Study name: runs/<study>/ and run ids <study>-<variant>-s<seed> "
                                                 "(default: study-<date>-<time>)."),
    as_json: JsonOption = False,
) -> None:
    """Run one configuration under N seeds and the given variants (the AgentRL paper's ablations), each
    a `rollstream up` run of its own; write runs/<study>/study.json (per variant and family: seeds,
    seeds_improved, seeds_worse, mean_change) and study.png. A failed run is recorded and skipped.

    Example: rollstream study --config configs/cpu.yaml --seeds 3 --variants base,no-task-norm,no-cross,trajectory-mix
    """
    chosen = parse_variants(variants)  # an unknown variant is a ConfigError: one line, exit 2
    cfg = load_config(config)
    study_name = name or time.strftime("study-%Y%m%d-%H%M%S")
    console = Console(stderr=True)
    try:
        document = run_study(cfg, study_name, seeds, chosen, first_seed=first_seed, config_path=config,
                             say=timestamped(console))
    except StudyExists as error:
        fail(str(error))
    if as_json:
        typer.echo(json.dumps(document, indent=2, sort_keys=True))
    else:
        table = Table("variant", "family", "seeds improved / worse", "mean change", title=f"Study {study_name}")
        for row in table_rows(document["results"]):
            table.add_row(*row)
        Console().print(table)
        failed = document["failed"]
        console.print(f"study {study_name}: {len(document['runs'])} runs, {len(failed)} failed; "
                      f"{Path(document['folder']) / 'study.json'}")
    if document["interrupted"]:
        raise typer.Exit(code=INTERRUPTED)
