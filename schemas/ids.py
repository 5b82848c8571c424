"""The deterministic ids of the event contract.

Every consumer de-duplicates by these (ARCHITECTURE.md "Delivery guarantees"), so whoever computes one
must compute it exactly like this: they live here, beside the schemas, not in one producer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def group_id(run: str, task: str, split: str, sample_index: int, epoch: int) -> str:
    """The first 32 hex digits of sha256(run, task, split, sample_index, epoch)."""
    key = "\x1f".join((run, task, split, str(sample_index), str(epoch)))
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def trajectory_id(run: str, group_id: str, member: int) -> str:
    """sha256 of (run, group_id, member): every re-rollout of one member gets the same id."""
    return hashlib.sha256(json.dumps([run, group_id, member]).encode()).hexdigest()


def batch_id(run: str, group_ids: Sequence[str]) -> str:
    """sha256 of the run and the sorted group ids (order-insensitive)."""
    h = hashlib.sha256(run.encode())
    for gid in sorted(group_ids):
        h.update(b"\x1f" + gid.encode())
    return h.hexdigest()
