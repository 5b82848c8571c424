"""Learner checkpoints in the object store: everything needed to resume exactly.

A checkpoint holds the model and optimizer state dicts, the RNG states, the step, the policy
version the step produced, the consumed `batches` offsets and the ids of every batch applied so
far (so a resumed learner neither trains a batch twice nor skips one). Layout:

    s3://rollstream-checkpoints/<run>/step-<step:08d>/state.pt   torch.save of the whole state
    s3://rollstream-checkpoints/<run>/step-<step:08d>/meta.json  step, version (small, for listings)
    s3://rollstream-checkpoints/<run>/latest.json                pointer to the newest complete one

With SAO (learner/sao.py) the critic's value head and its optimizer are kept too, under `critic`:
they are not part of the policy's state dict, so they are never published to engines, and a resumed
learner's advantages come from the critic it had.

The pointer is written last, so a learner killed while writing a checkpoint resumes from the
previous complete one.

The model and optimizer states are the whole ones (`full_weights`, `full_optimizer_state`: torch's
distributed-checkpoint state dicts, the optimizer's keyed by parameter name), so one checkpoint
resumes one process, DDP ranks or FSDP ranks alike.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from minio import Minio
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from minio.error import S3Error

from schemas import objectstore, topics

LATEST = "latest.json"
STATE_FILE = "state.pt"
META_FILE = "meta.json"


def step_prefix(run: str, step: int) -> str:
    """Object-key prefix of one checkpoint: <run>/step-<step:08d>/."""
    return f"{run}/step-{step:08d}/"


@dataclass
class TrainingState:
    """Where training stands, apart from the tensors: what a checkpoint records besides them."""

    step: int = 0
    """Optimizer steps taken."""
    version: int = 0
    """Policy version of the current weights (0 = initial)."""
    offsets: dict[int, int] = field(default_factory=dict)
    """`batches` partition -> next offset to read (everything before it is consumed)."""
    applied_batch_ids: list[str] = field(default_factory=list)
    """Batches trained on, in order; the last one produced `version`."""

    def to_plain(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "offsets": dict(self.offsets),
                "applied_batch_ids": list(self.applied_batch_ids)}

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> TrainingState:
        return cls(step=int(data["step"]), version=int(data["version"]),
                   offsets={int(p): int(o) for p, o in data["offsets"].items()},
                   applied_batch_ids=list(data["applied_batch_ids"]))


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    state: TrainingState
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    uri: str
    critic: dict[str, Any] | None = None
    """SAO's value head and its optimizer (learner/sao.py Critic.state); None without SAO."""


# Whole tensors, on CPU, on rank 0 only (other ranks get {}): a gather when the model is sharded.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict (tied tensors under each name). Under FSDP every rank must call it."""
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name. Under FSDP every rank must call it."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a `full_optimizer_state` into the optimizer of the whole (unsharded) model."""
    set_optimizer_state_dict(model, optimizer, state)


def rng_states() -> dict[str, Any]:
    """The process's RNG states (torch CPU, CUDA when present, Python's random)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(
    mc: Minio,
    run: str,
    state: TrainingState,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    critic_state: dict[str, Any] | None = None,
) -> str:
    """Writes a checkpoint, then moves the latest pointer to it; returns its state URI. `critic_state`:
    SAO's critic (learner/sao.py Critic.state), kept beside the policy's state, never in it.

    The state goes through a temporary file, so a large model is uploaded in parts instead of
    being held twice in memory.
    """
    prefix = step_prefix(run, state.step)
    payload = {"state": state.to_plain(), "model": model_state, "optimizer": optimizer_state,
               "rng": rng_states()}
    if critic_state is not None:
        payload["critic"] = critic_state
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / STATE_FILE
        torch.save(payload, path)
        objectstore.put_file(mc, topics.CHECKPOINTS_BUCKET, prefix + STATE_FILE, path)
    meta = json.dumps({"step": state.step, "version": state.version}).encode()
    objectstore.put_bytes(mc, topics.CHECKPOINTS_BUCKET, prefix + META_FILE, meta, "application/json")
    pointer = json.dumps({"step": state.step, "version": state.version, "key": prefix + STATE_FILE}).encode()
    objectstore.put_bytes(mc, topics.CHECKPOINTS_BUCKET, f"{run}/{LATEST}", pointer, "application/json")
    return objectstore.uri(topics.CHECKPOINTS_BUCKET, prefix + STATE_FILE)


def _get_json(mc: Minio, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(objectstore.get_bytes(mc, topics.CHECKPOINTS_BUCKET, key))
    except S3Error as e:
        if e.code == "NoSuchKey":
            return None
        raise


def load_latest(mc: Minio, run: str) -> Checkpoint | None:
    """The newest complete checkpoint of `run`, or None when it has none."""
    pointer = _get_json(mc, f"{run}/{LATEST}")
    if pointer is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / STATE_FILE
        objectstore.get_file(mc, topics.CHECKPOINTS_BUCKET, pointer["key"], path)
        payload = torch.load(path, map_location="cpu", weights_only=True)
    return Checkpoint(state=TrainingState.from_plain(payload["state"]), model=payload["model"],
                      optimizer=payload["optimizer"], rng=payload["rng"],
                      uri=objectstore.uri(topics.CHECKPOINTS_BUCKET, pointer["key"]), critic=payload.get("critic"))


def list_checkpoints(mc: Minio, run: str) -> list[tuple[int, int]]:
    """(step, version) of every checkpoint of `run`, ascending by step."""
    found = []
    for obj in mc.list_objects(topics.CHECKPOINTS_BUCKET, prefix=f"{run}/step-", recursive=False):
        meta = _get_json(mc, obj.object_name + META_FILE)
        if meta is not None:
            found.append((int(meta["step"]), int(meta["version"])))
    return sorted(found)


def prune_checkpoints(mc: Minio, run: str, keep: int) -> list[int]:
    """Deletes all but the newest `keep` checkpoints (never the one latest.json names)."""
    steps = [step for step, _ in list_checkpoints(mc, run)]
    deleted = []
    for step in steps[: max(0, len(steps) - keep)]:
        for obj in mc.list_objects(topics.CHECKPOINTS_BUCKET, prefix=step_prefix(run, step), recursive=True):
            mc.remove_object(topics.CHECKPOINTS_BUCKET, obj.object_name)
        deleted.append(step)
    return deleted
