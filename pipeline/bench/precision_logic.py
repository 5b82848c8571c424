"""Pure figures of `rollstream bench precision` (pipeline/bench/precision.py): log-prob agreement and rates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def agreement(engine_logprobs: Sequence[Sequence[float]], learner_logprobs: Sequence[Sequence[float]],
              clip_low: float, clip_high: float) -> dict[str, Any]:
    """How far the learner's log-probs of the engine's sampled tokens are from the engine's own.

    PPO's ratio on the first step after a rollout is exp(learner - engine): 1 where the two agree. Reported
    over every token: mean, p99 and largest |difference|, the mean difference (a bias the clip does not
    see), and the share of tokens whose ratio already lies outside the clip range [1 - clip_low,
    1 + clip_high] before any update, which the PPO loss would clip for precision alone."""
    if len(engine_logprobs) != len(learner_logprobs):
        raise ValueError(f"{len(engine_logprobs)} engine sequences against {len(learner_logprobs)} learner ones")
    pairs = [(np.asarray(e, dtype=np.float64), np.asarray(l, dtype=np.float64))
             for e, l in zip(engine_logprobs, learner_logprobs, strict=True)]
    for i, (e, l) in enumerate(pairs):
        if e.shape != l.shape:
            raise ValueError(f"sequence {i}: {e.size} engine log-probs against {l.size} learner ones")
    if not pairs or not sum(e.size for e, _ in pairs):
        raise ValueError("no tokens to compare")
    diff = np.concatenate([l - e for e, l in pairs])  # log ratio learner / engine per token
    ratio = np.exp(diff)
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return {"tokens": int(diff.size), "mean_abs": float(np.abs(diff).mean()),
            "p99_abs": float(np.quantile(np.abs(diff), 0.99)), "max_abs": float(np.abs(diff).max()),
            "mean": float(diff.mean()), "outside_clip": float(outside.mean())}


def rate(tokens: int, seconds: float) -> dict[str, Any]:
    """One measured rate: tokens, seconds and tokens per second."""
    if seconds <= 0:
        raise ValueError(f"a rate needs positive seconds, got {seconds}")
    return {"tokens": int(tokens), "seconds": round(seconds, 4), "tokens_per_s": tokens / seconds}


def speedup(rates: dict[str, dict[str, Any]]) -> float:
    """bfloat16's tokens/s over float32's."""
    return rates["bfloat16"]["tokens_per_s"] / rates["float32"]["tokens_per_s"]
