"""`rollstream loss`: the learner's policy loss on per-token arrays from a JSON file, for checking its numerics.

Uses exactly the functions the learner's training step calls (learner.loss.policy_loss; with
`--loss sao`, learner.sao.batch_gae then learner.loss.dis_policy_loss), on the arrays as given: no
model, no shift (position t of every list is the same token). float64, so the printed values are the
formula's; the learner computes in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import typer
from pydantic import ValidationError

from learner.loss import dis_policy_loss, policy_loss
from learner.sao import batch_gae
from learner.settings import ISCorrection, ISLevel, LearnerSettings
from pipeline.cli.toolkit import App, JsonOption, fail, read_json_lists
from pipeline.run.config import validation_message

app = App()

_ARRAYS = ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "loss_mask")
_OPTIONAL_ARRAYS = ("prox_logprobs",)
_SETTINGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_coef", "kl_clamp", "is_cap")
# --loss sao: the critic's values instead of advantages, and one reward per sequence (learner/sao.py)
_SAO_ARRAYS = ("logprobs", "old_logprobs", "ref_logprobs", "values", "loss_mask")
_SAO_SETTINGS = ("gae_gamma", "gae_lambda", "dis_low", "dis_high", "kl_coef", "kl_clamp")
_DEFAULTS = LearnerSettings()
Loss = Literal["ppo", "cispo", "decoupled", "sao"]
"""learner.policy_loss, or "sao" for learner.advantage_estimator sao (its own actor loss)."""


def _read(path: Path, sao: bool) -> dict[str, Any]:
    if sao:
        return read_json_lists(path, _SAO_ARRAYS + ("rewards",), known=_SAO_ARRAYS + ("rewards",) + _SAO_SETTINGS)
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
    objective: Loss = typer.Option(_DEFAULTS.policy_loss, "--loss", help="learner.policy_loss, or sao "
                                   "(learner.advantage_estimator sao: values and rewards instead of advantages)."),
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

    --loss sao (SAO, seed 000 §7.1) takes values (V of the state before
    each token) and rewards (one number per sequence) instead of advantages,
    and the settings gae_gamma, gae_lambda, dis_low, dis_high, kl_coef,
    kl_clamp. Over each sequence's loss_mask 1 tokens k = 0..K-1 in order
    (the tokens between them skipped), with V_K = 0:

    delta_k = [k = K-1] R + gae_gamma * V_{k+1} - V_k
    A_k = delta_k + gae_gamma * gae_lambda * A_{k+1};  G_k = A_k + V_k
    rho = exp(lp - behav);  gate = 1 if dis_low <= rho <= dis_high, else 0
    pg = -gate * A * rho;  value_loss = mean 0.5 * (V - G)^2
    """
    if objective == "sao":
        _sao_loss(input_path, is_correction, is_level, as_json)
        return
    data = _read(input_path, sao=False)
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


def _sao_loss(input_path: Path, is_correction: ISCorrection, is_level: ISLevel, as_json: bool) -> None:
    """--loss sao: skip-observation GAE from the values and rewards, then SAO's DIS-gated actor loss."""
    data = _read(input_path, sao=True)
    try:
        settings = LearnerSettings(advantage_estimator="sao", is_correction=is_correction, is_level=is_level,
                                   **{k: data[k] for k in _SAO_SETTINGS if k in data})
    except ValidationError as e:
        fail(f"invalid settings: {validation_message(e)}")
    arrays = _padded(data, _SAO_ARRAYS)
    rewards = data["rewards"]
    if len(rewards) != arrays["loss_mask"].shape[0] or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        fail(f"invalid input: rewards must hold one number per sequence ({arrays['loss_mask'].shape[0]})")
    advantages, returns = batch_gae(arrays["values"].numpy(), arrays["loss_mask"].numpy(), np.asarray(rewards, float),
                                    settings.gae_gamma, settings.gae_lambda)  # (B, T) each
    advantages_t, returns_t = torch.from_numpy(advantages), torch.from_numpy(returns)
    logprobs = arrays["logprobs"].clone().requires_grad_(True)  # (B, T)
    try:
        total, metrics = dis_policy_loss(
            logprobs, arrays["old_logprobs"], arrays["ref_logprobs"], advantages_t, arrays["loss_mask"],
            torch.zeros_like(logprobs), int(arrays["loss_mask"].sum()), dis_low=settings.dis_low,
            dis_high=settings.dis_high, kl_coef=settings.kl_coef, kl_clamp=settings.kl_clamp, entropy_coef=0.0)
    except ValueError as e:
        fail(f"invalid input: {e}")
    total.backward()
    action = arrays["loss_mask"] > 0
    value_loss = 0.5 * float(((arrays["values"] - returns_t)[action] ** 2).mean())
    lengths = [len(row) for row in data["logprobs"]]
    result: dict[str, Any] = {
        "loss": float(total.detach()),
        "pg_loss": float(metrics["actor/pg_loss"]),
        "kl_loss": float(metrics["actor/kl_loss"]),
        "value_loss": value_loss,
        "metrics": {name: float(value) for name, value in metrics.items() if name != "actor/entropy"},
        "advantages": [advantages[b, :n].tolist() for b, n in enumerate(lengths)],
        "returns": [returns[b, :n].tolist() for b, n in enumerate(lengths)],
        "grad_logprobs": [logprobs.grad[b, :n].tolist() for b, n in enumerate(lengths)],
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"sao (gamma {settings.gae_gamma}, lambda {settings.gae_lambda}, DIS [{settings.dis_low}, "
               f"{settings.dis_high}])")
    for name in ("loss", "pg_loss", "kl_loss", "value_loss"):
        typer.echo(f"{name:<18} {result[name]:+.6g}")
    for name, value in result["metrics"].items():
        if name not in ("actor/pg_loss", "actor/kl_loss"):
            typer.echo(f"{name.removeprefix('actor/'):<18} {value:+.6g}")
    for b, row in enumerate(result["advantages"]):
        typer.echo(f"advantages[{b}]      " + " ".join(f"{a:+.4g}" for a in row))
