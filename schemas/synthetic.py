"""Synthetic events of a run: a group member's trajectory and a learner's weight version.

The examples of schemas/samples.py, re-addressed to a run and a group and sized at will, so that
a benchmark can feed the stream processor realistic load and a test can build the events a
component consumes without running the components that produce them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas import arrays, samples
from schemas.bus import now_ms


def trajectory(run: str, group_id: str, member: int, group_size: int, reward: float, *, task: str = "db",
               num_tokens: int = 16, status: str = "completed", version: int = 0, sample_index: int = 0,
               validation: bool = False, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """A valid trajectory event of one group member (schemas.samples.trajectory, re-addressed);
    token ids and logprobs drawn from `rng` when given, else deterministic."""
    # the example's arrays built with numpy: Python lists of 8k tokens took longer than a benchmark's own work
    t = samples.trajectory(member=member, num_tokens=0, reward=reward)
    prompt = num_tokens // 2
    mask = np.repeat(np.array([0, 1], dtype=np.uint8), [prompt, num_tokens - prompt])
    ids = rng.integers(0, 264, num_tokens) if rng is not None else (np.arange(num_tokens) * 7 + member) % 256
    logprobs = (np.concatenate([np.zeros(prompt), -rng.exponential(1.0, num_tokens - prompt)]) if rng is not None
                else -0.25 * mask)
    t.update(input_ids=arrays.pack_ids(ids), loss_mask=arrays.pack_mask(mask),
             rollout_logprobs=arrays.pack_logprobs(logprobs), num_tokens=num_tokens, prompt_tokens=prompt)
    t["turns"] = [{**t["turns"][0], "start": prompt, "length": num_tokens - prompt}]
    t.update(trajectory_id=f"{group_id}-{member}", run=run, group_id=group_id, group_size=group_size, task=task,
             status=status, sample_index=sample_index, validation=validation, finished_at_ms=now_ms())
    t["turns"] = [{**turn, "weight_version": version} for turn in t["turns"]]
    return t


def weights(run: str, version: int) -> dict[str, Any]:
    """A weight_version event of the run (what the learner publishes after each step)."""
    return {**samples.weight_version(), "run": run, "version": version, "step": version,
            "published_at_ms": now_ms()}
