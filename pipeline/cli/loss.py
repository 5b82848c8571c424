"""`rollstream loss`: the learner's policy loss on per-token arrays from a JSON file, for checking its numerics.

Uses exactly the function the learner's training step calls (learner.loss.policy_loss), on the
arrays as given: no model, no shift (position t of every list is the same token). float64, so the
printed values are the formula's; the learner computes in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from pydantic import ValidationError

from learner.loss import policy_loss
from learner.settings import ISCorrection, ISLevel, LearnerSettings, PolicyLoss
from pipeline.cli.toolkit import App, JsonOption, fail, read_json_lists
from pipeline.run.config import validation_message

app = App()

_ARRAYS = ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "loss_mask")
_OPTIONAL_ARRAYS = ("prox_logprobs",)
_SETTINGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_coef", "kl_clamp", "is_cap")
_DEFAULTS = LearnerSettings()


def _read(path: Path) -> dict[str, Any]:
    return read_json_lists(path, _ARRAYS, known=_ARRAYS + _OPTIONAL_ARRAYS + _SETTINGS)


def _padded(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The per-sequence lists as (B, T) float64 tensors, right-padded with 0 (mask 0: no effect on the loss)."""
    sequences = {name: len(data[name]) for name in names}
    if len(set(sequences.values())) != 1:
        fail("one list per sequence expected, got " + ", ".join(f"{k} {v}" for k, v in sequences.items()))
    rows = []
    for i in range(sequences[names[0]]):
        try:
            row = {name: np.asarray(data[name][i], dtype=np.float64) for name in names}
        except (TypeError, ValueError) as e:
            fail(f"invalid input: sequence {i}: {e}")
        lengths = {name: a.shape for name, a in row.items()}
        if any(len(shape) != 1 for shape in lengths.values()) or len(set(lengths.values())) != 1:
            fail(f"sequence {i}: every list must hold the same number of numbers, got "
                 + ", ".join(f"{k} {list(v)}" for k, v in lengths.items()))
        rows.append(row)
    if not rows:
        fail("invalid input: no sequence")
    width = max(len(row[names[0]]) for row in rows)
    out = {name: torch.zeros(len(rows), width, dtype=torch.float64) for name in names}  # (B, T)
    for b, row in enumerate(rows):
        for name, array in row.items():
            out[name][b, : len(array)] = torch.from_numpy(array)
    if not bool(((out["loss_mask"] == 0) | (out["loss_mask"] == 1)).all()):
        fail("invalid input: loss_mask holds values other than 0 and 1")
    return out


@app.command()
def loss(
    input_path: Path = typer.Option(..., "--input", help="JSON object with logprobs, old_logprobs, ref_logprobs, "
                                    "advantages, loss_mask (one list per sequence), optionally prox_logprobs and "
                                    "settings by name."),
    objective: PolicyLoss = typer.Option(_DEFAULTS.policy_loss, "--loss", help="learner.policy_loss."),
    is_correction: ISCorrection = typer.Option(_DEFAULTS.is_correction, "--is", help="learner.is_correction."),
    is_level: ISLevel = typer.Option(_DEFAULTS.is_level, "--is-level", help="learner.is_level."),
    as_json: JsonOption = False,
) -> None:
    """Print the learner's loss, pg_loss and kl_loss on the given arrays.

    Example:

        rollstream loss --input example.json --loss cispo --json

    with example.json = {"logprobs": [[-1.0, -0.5]],
    "old_logprobs": [[-1.1, -0.4]], "ref_logprobs": [[-1.0, -0.6]],
    "advantages": [[1.0, 1.0]], "loss_mask": [[1, 1]], "kl_coef": 0.001}

    Settings in the file (else the learner's defaults): clip_ratio_low,
    clip_ratio_high, clip_ratio_c, kl_coef, kl_clamp, is_cap.
    prox_logprobs, if absent, is logprobs: the learner's value (one
    optimizer step per batch). Per action token, with lp = logprobs,
    behav = old_logprobs, prox = prox_logprobs, ref = ref_logprobs,
    A = advantages, e = clip_ratio_low/high, c = clip_ratio_c, C = is_cap,
    sg = stop-gradient:

    old = prox with --loss decoupled or an --is correction, else behav
    r = exp(lp - old);  rho = exp(prox - behav)
    --is-level token: per token; sequence: each log-ratio is replaced by
      its mean over the sequence's action tokens; chunk: by its mean over
      the token's run of consecutive loss_mask 1s (one assistant turn)
    --is none:   w = 1 (decoupled: w = rho)
    --is tis:    w = min(rho, C)
    --is icepop: w = rho where 1/C <= rho <= C, else 0
    ppo:        pg = w * max(-A*r, -A*clip(r, 1-e_low, 1+e_high)),
                and where A < 0: w * min(that, -A*c)
    decoupled:  as ppo (its old policy is always prox)
    cispo:      pg = -w * sg(clip(r, 1-e_low, 1+e_high)) * A * lp
    kl = clamp(exp(ref - lp) - (ref - lp) - 1, -kl_clamp, kl_clamp)
    loss = mean(pg) + kl_coef * mean(kl), means over loss_mask 1 tokens
    """
    data = _read(input_path)
    try:
        settings = LearnerSettings(policy_loss=objective, is_correction=is_correction, is_level=is_level,
                                   **{k: data[k] for k in _SETTINGS if k in data})
    except ValidationError as e:
        fail(f"invalid settings: {validation_message(e)}")
    given = tuple(name for name in _OPTIONAL_ARRAYS if data.get(name) is not None)
    arrays = _padded(data, _ARRAYS + given)
    logprobs = arrays["logprobs"].clone().requires_grad_(True)  # (B, T)
    prox = arrays["prox_logprobs"] if "prox_logprobs" in arrays else logprobs.detach()
    try:
        total, metrics = policy_loss(
            logprobs, arrays["old_logprobs"], arrays["ref_logprobs"], arrays["advantages"], arrays["loss_mask"],
            torch.zeros_like(logprobs), int(arrays["loss_mask"].sum()),
            clip_ratio_low=settings.clip_ratio_low, clip_ratio_high=settings.clip_ratio_high,
            clip_ratio_c=settings.clip_ratio_c, kl_coef=settings.kl_coef, kl_clamp=settings.kl_clamp,
            entropy_coef=0.0, prox_logprobs=prox, objective=settings.policy_loss,
            is_correction=settings.is_correction, is_level=settings.is_level, is_cap=settings.is_cap,
        )
    except ValueError as e:
        fail(f"invalid input: {e}")
    total.backward()
    lengths = [len(row) for row in data["logprobs"]]
    result: dict[str, Any] = {
        "loss": float(total.detach()),
        "pg_loss": float(metrics["actor/pg_loss"]),
        "kl_loss": float(metrics["actor/kl_loss"]),
        # actor/entropy is left out: without logits there is no entropy (its coefficient is 0 here).
        "metrics": {name: float(value) for name, value in metrics.items() if name != "actor/entropy"},
        # d loss / d logprobs per token: shows what the stop-gradients and clips let through.
        "grad_logprobs": [logprobs.grad[b, :n].tolist() for b, n in enumerate(lengths)],
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"{settings.policy_loss} + {settings.is_correction} ({settings.is_level} level)")
    for name in ("loss", "pg_loss", "kl_loss"):
        typer.echo(f"{name:<18} {result[name]:+.6g}")
    for name, value in result["metrics"].items():
        if name not in ("actor/pg_loss", "actor/kl_loss"):
            typer.echo(f"{name.removeprefix('actor/'):<18} {value:+.6g}")
