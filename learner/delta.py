"""Delta versions: a policy version staged as what changed against the version before it.

Encoding (`encode_delta`): per tensor, the raw bytes of the new version XOR those of the previous
one, compressed with zstd; a tensor whose bytes did not change is left out. An optimizer step at
RL learning rates (AgentRL's 1e-6) moves each weight by a few units in its last place, so the XOR
is zero in the sign, the exponent and the high mantissa bits, and mostly zero altogether in
bfloat16, where most weights do not move by a whole unit: zstd squeezes those runs. Staging only
the changed tensors (whole) would save nothing, since Adam moves every tensor that had a gradient
(measured: docs/BENCHMARKS.md, "bench weights"). XOR is exact on raw bytes, so applying it is
bit for bit whatever the dtype, NaN payloads and negative zeros included.

A delta's manifest (schemas/weight_layout.py) has `kind` "delta", its `base_version`, the `chain`
from the newest full snapshot to itself, and for every tensor the sha256 of the *result*:
`apply_delta` checks it after applying, so a corrupted change or a wrong base can never be served
(`ShardIntegrityError`, as for a corrupted shard). Its shards (`delta-*.safetensors`) hold one
uint8 tensor of compressed XOR per changed tensor, and are checked against their own sha256 first.

`catch_up_plan` is the pure rule of what a reader loads: the deltas after the version it holds when
that version is in the chain, else the chain's snapshot and then every delta.

Bytes and tensors only, no object store: learner/publish.py stages, pipeline/engine/updates.py
fetches and applies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zstandard

from learner.manifest import ShardIntegrityError, specs_of, tensor_bytes, tensor_sha256, torch_dtype, verify_shard
from schemas.weight_layout import ShardEntry, TensorEntry, WeightManifest


def delta_file_name(index: int, count: int) -> str:
    """Delta shards are named apart from full ones, so no tool mistakes one for the other."""
    return f"delta-{index + 1:05d}-of-{count:05d}.safetensors"


def _words(data: memoryview | bytes) -> np.ndarray:
    """The bytes as the widest unsigned integers that divide their length (XOR is 8x faster on
    uint64 than on uint8 and gives the same bytes)."""
    size = len(data)
    for dtype in (np.uint64, np.uint32, np.uint16):
        if size % np.dtype(dtype).itemsize == 0:
            return np.frombuffer(data, dtype=dtype)
    return np.frombuffer(data, dtype=np.uint8)


def encode_change(previous: torch.Tensor, new: torch.Tensor, compressor: zstandard.ZstdCompressor) -> bytes | None:
    """zstd(previous XOR new) over the raw bytes, or None when they are equal."""
    change = np.bitwise_xor(_words(tensor_bytes(previous)), _words(tensor_bytes(new)))
    if not change.any():
        return None
    return compressor.compress(change)


def apply_change(base: torch.Tensor, change: bytes, decompressor: zstandard.ZstdDecompressor) -> torch.Tensor:
    """The tensor `encode_change(base, result)` came from: base XOR the decompressed change.

    The change is decompressed straight into the result's memory and XORed there: one allocation of
    the tensor's size per tensor (an update of a 1 GB model allocates 1 GB, not 2)."""
    raw = tensor_bytes(base)
    result = torch.empty(base.shape, dtype=base.dtype)
    out = tensor_bytes(result)  # a view of result's memory
    filled, extra = 0, b""
    try:
        with decompressor.stream_reader(change) as reader:
            while filled < len(out) and (n := reader.readinto(out[filled:])):
                filled += n
            extra = reader.read(1)
    except zstandard.ZstdError as error:
        raise ShardIntegrityError(f"undecodable change: {error}") from None
    if filled != len(out) or extra:
        raise ShardIntegrityError(f"change of {'more than ' if extra else ''}{filled} bytes for a tensor of {len(raw)}")
    words = _words(out)
    np.bitwise_xor(words, _words(raw), out=words)
    return result


def encode_delta(
    previous: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    *,
    version: int,
    step: int,
    config: Mapping[str, Any],
    base_chain: Sequence[int],
    max_shard_bytes: int,
    zstd_level: int,
    zstd_threads: int = 0,
) -> tuple[WeightManifest, dict[str, bytes]]:
    """Version `version` as a delta on `previous` (version - 1, whose chain is `base_chain`).

    Returns the manifest and {delta shard name: bytes}. Raises ValueError when the two versions do
    not have the same tensors (names, order, shapes, dtypes): such a version must be staged full.
    """
    if specs_of(previous) != specs_of(tensors):
        raise ValueError(f"version {version} has other tensors than version {version - 1}: stage it full")
    if not base_chain or base_chain[-1] != version - 1:
        raise ValueError(f"chain {tuple(base_chain)} does not end at version {version - 1}")
    compressor = zstandard.ZstdCompressor(level=zstd_level, threads=zstd_threads)
    changes: dict[str, bytes] = {}
    for name, tensor in tensors.items():
        change = encode_change(previous[name], tensor, compressor)
        if change is not None:
            changes[name] = change
    # Shards of at most max_shard_bytes of compressed changes, in tensor order (a larger change alone).
    groups: list[list[str]] = [[]]
    size = 0
    for name, change in changes.items():
        if groups[-1] and size + len(change) > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += len(change)
    shards: dict[str, bytes] = {}
    shard_of: dict[str, str] = {}
    for index, names in enumerate(groups):
        file = delta_file_name(index, len(groups))
        shards[file] = safetensors.torch.save(
            {n: torch.frombuffer(bytearray(changes[n]), dtype=torch.uint8) for n in names})
        shard_of.update(dict.fromkeys(names, file))
    manifest = WeightManifest(
        version=version,
        step=step,
        config=dict(config),
        kind="delta",
        base_version=version - 1,
        chain=(*base_chain, version),
        # An unchanged tensor names the first shard: it is absent there, and that absence means "as the base".
        tensors=tuple(TensorEntry(name=s.name, shape=s.shape, dtype=s.dtype,
                                  shard=shard_of.get(s.name, delta_file_name(0, len(groups))),
                                  sha256=tensor_sha256(tensors[s.name])) for s in specs_of(tensors)),
        shards=tuple(ShardEntry(file=f, sha256=hashlib.sha256(d).hexdigest(), size_bytes=len(d)) for f, d in shards.items()),
    )
    return manifest, shards


def apply_delta(
    base: Mapping[str, torch.Tensor],
    manifest: WeightManifest,
    shards: Mapping[str, bytes],
    *,
    base_checksums: Mapping[str, str] | None = None,
    workers: int = 1,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The version `manifest` describes, from its delta shards applied on `base` (its base version).

    Every shard is checked against its sha256, then every result tensor against the manifest's
    sha256 of it; returns (tensors, their sha256). `base_checksums` are the base tensors' verified
    sha256: an unchanged tensor whose sha256 is already known to be the expected one is not hashed
    again. Raises ShardIntegrityError on any mismatch; `base` is never modified. `workers` > 1 applies
    and hashes that many tensors at once (each holds one more tensor-sized buffer while it works).
    """
    if manifest.kind != "delta":
        raise ShardIntegrityError(f"version {manifest.version} is not a delta")
    loaded: dict[str, torch.Tensor] = {}
    for entry in manifest.shards:
        if entry.file not in shards:
            raise ShardIntegrityError(f"delta shard {entry.file} of version {manifest.version} is missing")
        verify_shard(entry, shards[entry.file])
        loaded.update(safetensors.torch.load(shards[entry.file]))

    def result_of(t: TensorEntry) -> tuple[torch.Tensor, str]:
        if t.sha256 is None:
            raise ShardIntegrityError(f"version {manifest.version}: tensor {t.name} has no sha256 to check")
        held = base.get(t.name)
        if held is None or tuple(held.shape) != t.shape or held.dtype != torch_dtype(t.dtype):
            raise ShardIntegrityError(f"version {manifest.version}: the base has no tensor {t.name} {t.shape} {t.dtype}")
        if t.name not in loaded:
            known = (base_checksums or {}).get(t.name)
            tensor, digest = held, known if known == t.sha256 else tensor_sha256(held)
        else:
            # A decompressor per tensor: they are not thread-safe, and one costs microseconds to make.
            tensor = apply_change(held, loaded[t.name].numpy().tobytes(), zstandard.ZstdDecompressor())
            digest = tensor_sha256(tensor)
        if digest != t.sha256:
            raise ShardIntegrityError(f"version {manifest.version}: tensor {t.name} has sha256 {digest[:12]}… after "
                                      f"applying the delta, the manifest says {t.sha256[:12]}…")
        return tensor, digest

    if workers > 1:
        # zstd, numpy's XOR and sha256 release the GIL; hashing the result is most of the work.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(result_of, manifest.tensors))
    else:
        done = [result_of(t) for t in manifest.tensors]
    names = [t.name for t in manifest.tensors]
    return ({n: tensor for n, (tensor, _) in zip(names, done)},
            {n: digest for n, (_, digest) in zip(names, done)})


def catch_up_plan(chain: Sequence[int], held: int | None) -> tuple[int | None, list[int]]:
    """(snapshot to load first or None, deltas to apply in order) to reach `chain[-1]`.

    A reader holding a version of the chain applies only the deltas after it; one holding nothing,
    or a version outside the chain (too far behind, or on another chain), starts from the snapshot.
    """
    if not chain:
        raise ValueError("empty chain")
    if held is not None and held in chain:
        return None, list(chain[chain.index(held) + 1:])
    return chain[0], list(chain[1:])
