"""`rollstream advantages`: GRPO plus per-task normalization (or ERPO) on a JSON file, for checking settings.

Uses exactly the functions the aggregator and the batcher use (streams.advantages).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import typer

from pipeline.cli.toolkit import App, fail, read_json_lists
from streams.advantages import batch_advantages, grpo_advantages
from streams.settings import AdvNorm, StdKind, StreamsSettings

app = App()

_FIELDS = ("rewards", "group_ids", "task_ids", "loss_masks")


def _read(path: Path) -> dict[str, list[Any]]:
    data = read_json_lists(path, _FIELDS)
    lengths = {f: len(data[f]) for f in _FIELDS}
    if len(set(lengths.values())) != 1:
        fail("one entry per trajectory expected, got " + ", ".join(f"{k} {v}" for k, v in lengths.items()))
    return data


def _task_scale(text: str, task_ids: list[Any]) -> dict[Any, float]:
    """`--task-scale`: TASK=S pairs, each S a positive number and each TASK one of the input's task ids (compared
    as text: the JSON may hold them as numbers), keyed as the input holds them."""
    if not text:
        return {}
    by_name = {str(task): task for task in task_ids}
    scales: dict[Any, float] = {}
    for pair in text.split(","):
        name, sep, value = pair.partition("=")
        malformed = f"--task-scale: expected TASK=S with S a positive number, got {pair!r}"
        try:
            scale = float(value)
        except ValueError:
            fail(malformed)
        if not sep or not scale > 0:  # `not >`: NaN too
            fail(malformed)
        if name not in by_name:
            fail(f"--task-scale names {name!r}, not a task of the input ({', '.join(sorted(by_name))})")
        scales[by_name[name]] = scale
    return scales


@app.command()
def advantages(
    input_path: Path = typer.Option(..., "--input", help="JSON object with rewards, group_ids, task_ids, loss_masks."),
    std: StdKind = typer.Option(StreamsSettings().std, help="Std of GRPO and task normalization: bessel or population."),
    eps: float = typer.Option(StreamsSettings().eps, help="Added to every std."),
    task_adv_norm: bool = typer.Option(StreamsSettings().task_adv_norm, help="Normalize per task (AgentRL's "
                                       "task_adv_norm); off: final advantages are the GRPO ones."),
    adv_norm: AdvNorm = typer.Option(StreamsSettings().adv_norm, "--adv-norm", help="group: GRPO's group std "
                                     "(then --task-adv-norm); erpo: (R - group mean) / (std of the task's rewards + "
                                     "eps), with --no-task-adv-norm."),
    positive_only: bool = typer.Option(False, "--positive-only", help="max(A, 0) after the normalization, as the "
                                       "batcher's first streams.positive_only_steps batches."),
    task_scale: str = typer.Option("", "--task-scale", help="TASK=S,...: each named task's final advantages times "
                                   "S, last (streams.task_advantage_scale); tasks not named 1."),
) -> None:
    """Print GRPO advantages, per-task token stats and final advantages as one JSON object.

    Example:

        rollstream advantages --input example.json --std population

        rollstream advantages --input example.json --adv-norm erpo --no-task-adv-norm

        rollstream advantages --input example.json --task-scale os=0.5

    with example.json = {"rewards": [1, 0], "group_ids": [0, 0], "task_ids": ["os", "os"],
    "loss_masks": [[0, 1, 1], [0, 1, 0]]}
    """
    if adv_norm == "erpo" and task_adv_norm:
        fail("--adv-norm erpo replaces the per-task normalization: add --no-task-adv-norm")
    data = _read(input_path)
    scales = _task_scale(task_scale, data["task_ids"])
    try:
        grpo = grpo_advantages(data["rewards"], data["group_ids"], std=std, eps=eps)
        counts = [int(np.count_nonzero(np.asarray(m))) for m in data["loss_masks"]]  # as task_normalize counts
        final, stats = batch_advantages(grpo, data["rewards"], data["group_ids"], data["task_ids"], counts, std=std,
                                        eps=eps, normalize=task_adv_norm, adv_norm=adv_norm,
                                        positive_only=positive_only, task_scale=scales)
    except (TypeError, ValueError) as e:
        fail(f"invalid input: {e}")
    task_stats = {str(task): {"mean": s.mean_before, "std": s.std_before, "tokens": s.tokens,
                              "trajectories": s.trajectories, "mean_after": s.mean_after,
                              "std_after": s.std_after} for task, s in stats.items()}
    typer.echo(json.dumps({"grpo": grpo.tolist(), "task_stats": task_stats, "final": final.tolist()}))
