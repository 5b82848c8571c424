"""A policy version as safetensors shards plus a manifest (schemas/weight_layout.py), and back.

Bytes and local directories only: uploading to and downloading from the object store is the
caller's job, so these functions are testable without MinIO. Reading always checks every
shard's sha256 and size against the manifest before trusting its bytes. Every tensor's own sha256
is recorded too (`tensor_sha256`): a delta version (learner/delta.py) is checked by it after being
applied, since its shards hold changes, not the tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from schemas.weight_layout import (
    DTYPE_SIZES,
    MANIFEST_FILE,
    ShardEntry,
    TensorEntry,
    TensorSpec,
    WeightManifest,
    plan_buckets,
)


class ShardIntegrityError(ValueError):
    """A shard's bytes do not match the manifest (sha256 or size), or a tensor is missing."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32": the dtype spelling of the weight contract."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """"float32" -> torch.float32."""
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {name!r}")
    return getattr(torch, name)


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The contract's description of named tensors, in the mapping's order."""
    return [TensorSpec(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype)) for n, t in tensors.items()]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a flat view (a copy only when it is not contiguous); any dtype,
    bfloat16 included, which numpy cannot hold."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex sha256 of a tensor's raw bytes: the per-tensor checksum of the weight contract."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's shard naming, so a version directory also loads with standard tools."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def encode_version(
    tensors: Mapping[str, torch.Tensor],
    *,
    version: int,
    step: int,
    config: Mapping[str, Any],
    max_shard_bytes: int,
    checksums: Mapping[str, str] | None = None,
) -> tuple[WeightManifest, dict[str, bytes]]:
    """Serializes named tensors into shards of at most `max_shard_bytes` (a larger tensor alone).

    Returns the manifest and {shard file name: bytes}. Tensors are cloned to CPU one shard at a
    time (safetensors refuses tensors that share storage, such as tied embeddings), so the extra
    memory is bounded by one shard. `checksums` are tensors' sha256 the caller has already checked
    (a version rebuilt from a delta chain): hashing them again would cost a pass over the weights.
    """
    groups = plan_buckets(specs_of(tensors), max_shard_bytes)
    shards: dict[str, bytes] = {}
    shard_entries: list[ShardEntry] = []
    tensor_entries: list[TensorEntry] = []
    for group in groups:
        file = shard_file_name(group.index, len(groups))
        contents = {s.spec.name: tensors[s.spec.name].detach().to("cpu", copy=True).contiguous() for s in group.slots}
        data = safetensors.torch.save(contents)
        shards[file] = data
        shard_entries.append(ShardEntry(file=file, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)))
        tensor_entries.extend(
            TensorEntry(name=s.spec.name, shape=s.spec.shape, dtype=s.spec.dtype, shard=file,
                        sha256=(checksums or {}).get(s.spec.name) or tensor_sha256(contents[s.spec.name]))
            for s in group.slots
        )
    manifest = WeightManifest(
        version=version,
        step=step,
        config=dict(config),
        tensors=tuple(tensor_entries),
        shards=tuple(shard_entries),
    )
    return manifest, shards


def verify_shard(entry: ShardEntry, data: bytes) -> None:
    """Raises ShardIntegrityError unless `data` has the manifest's size and sha256."""
    if len(data) != entry.size_bytes:
        raise ShardIntegrityError(f"shard {entry.file}: {len(data)} bytes, manifest says {entry.size_bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ShardIntegrityError(f"shard {entry.file}: sha256 {digest} does not match the manifest's {entry.sha256}")


def decode_version(manifest: WeightManifest, shards: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """Verifies every shard, then returns the tensors in manifest order with checked shape and dtype.

    A delta version's shards hold changes: learner/delta.py `apply_delta` reads those."""
    if manifest.kind != "full":
        raise ShardIntegrityError(f"version {manifest.version} is a delta on version {manifest.base_version}: "
                                  f"apply it on its chain {manifest.chain} (learner/delta.py)")
    loaded: dict[str, torch.Tensor] = {}
    for entry in manifest.shards:
        if entry.file not in shards:
            raise ShardIntegrityError(f"shard {entry.file} is missing")
        verify_shard(entry, shards[entry.file])
        loaded.update(safetensors.torch.load(shards[entry.file]))
    result: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        if t.name not in loaded:
            raise ShardIntegrityError(f"tensor {t.name} is missing from shard {t.shard}")
        tensor = loaded[t.name]
        if tuple(tensor.shape) != t.shape or dtype_name(tensor.dtype) != t.dtype:
            raise ShardIntegrityError(
                f"tensor {t.name}: {tuple(tensor.shape)} {tensor.dtype} in the shard, manifest says {t.shape} {t.dtype}"
            )
        result[t.name] = tensor
    return result


def write_version(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    version: int,
    step: int,
    config: Mapping[str, Any],
    max_shard_bytes: int,
    checksums: Mapping[str, str] | None = None,
) -> WeightManifest:
    """Writes the shards and then manifest.json into `directory` (the manifest last, so a
    directory with a manifest is complete)."""
    manifest, shards = encode_version(
        tensors, version=version, step=step, config=config, max_shard_bytes=max_shard_bytes, checksums=checksums
    )
    directory.mkdir(parents=True, exist_ok=True)
    for file, data in shards.items():
        (directory / file).write_bytes(data)
    (directory / MANIFEST_FILE).write_bytes(manifest.to_json())
    return manifest


def read_version(directory: Path) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """Reads manifest.json and its shards from `directory`, verifying every shard."""
    manifest = WeightManifest.from_json((directory / MANIFEST_FILE).read_bytes())
    shards = {}
    for entry in manifest.shards:
        path = directory / entry.file
        if not path.exists():
            raise ShardIntegrityError(f"shard {entry.file} is missing from {directory}")
        shards[entry.file] = path.read_bytes()
    return manifest, decode_version(manifest, shards)
