"""The weight contract between the learner and the engines: manifest format and bucket layout.

A policy version travels two ways (ARCHITECTURE.md, "Two-speed weight sync"):

- **staged**: safetensors shards plus a JSON manifest (`WeightManifest`) in the object store,
  either the whole version (`kind` "full", a snapshot) or only what changed against the version
  before it (`kind` "delta", learner/delta.py), which an engine applies on top of the weights it
  holds; `chain` names the snapshot and every delta after it, so a reader that holds none of
  them starts from the snapshot;
- **broadcast**: flat byte buckets over a collective group. Sender and receiver must cut the
  tensors into identical buckets without exchanging anything but the bytes, so the layout is a
  pure function (`plan_buckets`) of the ordered tensor specs and the bucket size. Both sides
  derive the specs from the same manifest (`WeightManifest.specs`), so they agree by
  construction.

This module imports neither torch nor numpy: dtypes are torch's names without the `torch.`
prefix ("float32", "bfloat16", ...), and each side maps them to its own types.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_FORMAT = "rollstream.weights/1"
MANIFEST_FILE = "manifest.json"

# Bytes per element of each dtype we ship (torch names).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Every tensor starts at a multiple of this many bytes inside a bucket, so the receiver can view
# its bytes as any dtype above without a copy (a view needs an offset aligned to the item size).
BUCKET_ALIGNMENT = 16


class TensorSpec(BaseModel):
    """One named tensor: what the receiver needs to rebuild it from raw bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


class BucketSlot(BaseModel):
    """Where one tensor lies inside a bucket."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: TensorSpec
    offset: int


class Bucket(BaseModel):
    """One flat byte buffer sent in a single collective call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    nbytes: int
    slots: tuple[BucketSlot, ...]


def _align(offset: int) -> int:
    return -(-offset // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT


def plan_buckets(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> list[Bucket]:
    """Cuts the ordered tensors into buckets of at most `bucket_size_bytes` (aligned offsets).

    Tensors keep their order. A tensor that would push the open bucket past the size closes that
    bucket and opens the next one *with this tensor in it*; a tensor larger than the size gets a
    bucket of its own. No tensor is ever left out. (AgentRL's sender, on meeting a tensor that
    crosses the bucket size, flushes the bucket and moves on to the next tensor without adding
    the one that crossed, so that parameter silently never reaches the engines.)
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_size_bytes}")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")

    buckets: list[Bucket] = []
    slots: list[BucketSlot] = []
    end = 0  # bytes used by the open bucket

    def close() -> None:
        nonlocal slots, end
        if slots:
            buckets.append(Bucket(index=len(buckets), nbytes=end, slots=tuple(slots)))
        slots, end = [], 0

    for spec in specs:
        offset = _align(end)
        if slots and offset + spec.nbytes > bucket_size_bytes:
            close()
            offset = 0
        slots.append(BucketSlot(spec=spec, offset=offset))
        end = offset + spec.nbytes
    close()
    return buckets


class ShardEntry(BaseModel):
    """One safetensors shard of a version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(description="File name, relative to the manifest's directory or key prefix.")
    sha256: str = Field(description="Hex sha256 of the shard's bytes.")
    size_bytes: int


class TensorEntry(BaseModel):
    """One tensor of a version and the shard that holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: str = Field(description="The shard holding the tensor (a delta shard: its change, absent when unchanged).")
    sha256: str | None = Field(None, description="Hex sha256 of the tensor's raw bytes in the version (the "
                               "result, for a delta); None in manifests written before it was recorded.")


class WeightManifest(BaseModel):
    """A policy version: its tensors (in broadcast order), shards, and the model config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = MANIFEST_FORMAT
    version: int = Field(description="Policy version, 0 for the initial weights, +1 per step.")
    step: int = Field(description="Learner optimizer step that produced it.")
    config: dict = Field(description="The model's Hugging Face config (config.json contents).")
    tensors: tuple[TensorEntry, ...]
    shards: tuple[ShardEntry, ...]
    kind: Literal["full", "delta"] = Field("full", description="A whole version, or its change against `base_version`.")
    base_version: int | None = Field(None, description="A delta's base: the version it applies on (version - 1).")
    chain: tuple[int, ...] = Field((), description="From the newest full snapshot to this version, ascending: "
                                   "what a reader holding none of them loads, in order. () for a full version.")

    @model_validator(mode="after")
    def _chain_is_consistent(self) -> WeightManifest:
        # Readers walk the chain by version number alone, so it must be exactly snapshot..version.
        if self.kind == "full" and (self.base_version is not None or self.chain not in ((), (self.version,))):
            raise ValueError(f"full version {self.version} names a base or a chain")
        if self.kind == "delta":
            if self.base_version != self.version - 1:
                raise ValueError(f"delta version {self.version} must apply on version {self.version - 1}, "
                                 f"not {self.base_version}")
            if len(self.chain) < 2 or self.chain != tuple(range(self.chain[0], self.version + 1)):
                raise ValueError(f"delta version {self.version}: chain {self.chain} is not snapshot..{self.version}")
        return self

    @property
    def snapshot_version(self) -> int:
        """The full version this one is built on (itself when full)."""
        return self.chain[0] if self.chain else self.version

    def specs(self) -> list[TensorSpec]:
        """The tensor specs in manifest order: the input of `plan_buckets` on both sides."""
        return [TensorSpec(name=t.name, shape=t.shape, dtype=t.dtype) for t in self.tensors]

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys), so equal manifests have equal bytes."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> WeightManifest:
        """Parses and validates a manifest; raises ValueError on a wrong format."""
        manifest = cls.model_validate_json(data)
        if manifest.format != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {manifest.format!r}, expected {MANIFEST_FORMAT!r}")
        return manifest
