"""Staging a policy version in the object store, its `weights` event, and retention pruning.

Layout (ARCHITECTURE.md, "Two-speed weight sync"): a version lives under
`s3://rollstream-weights/<run>/v<version:06d>/` as safetensors shards plus `manifest.json`. The
shards go up first and the manifest last, so a version whose manifest exists is complete; the
`weights` event is sent only after the manifest is stored, so an engine that reads the event can
always load the version.

Tied tensors (lm_head.weight when the embeddings are tied) are published once, under the first
name (`tied_aliases`, `without_aliases`), in the manifest, the shards and the broadcast buckets
alike, as Hugging Face checkpoints store them: the version's config says `tie_word_embeddings`,
and loaders (transformers, vLLM) tie lm_head to the embedding themselves.

Delta versions (learner/delta.py): `VersionStager` stages a version as its change against the
previous one, except every `snapshot_interval`-th version, version 0, and the first version after a
restart (the stager no longer holds the previous weights), which are full snapshots. It converts the
weights once to the engines' dtype (`served_tensors`), so the change is taken, staged and broadcast
in the dtype the engines serve.

Retention (`retained_versions`) is a pure rule: keep the newest `keep_last` versions (engines of
the current pool that missed a broadcast load one of these), the newest `keep_stale` versions the
stale pool can be serving (multiples of `stale_step`, the versions it is refreshed to), every
version a checkpoint still names, and for each of those the whole chain it is built on (its
snapshot and the deltas before it), without which it cannot be loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from minio import Minio

from learner import delta
from learner.manifest import encode_version, torch_dtype
from schemas import objectstore, topics
from schemas.weight_layout import MANIFEST_FILE, WeightManifest

_VERSION_DIR = re.compile(r"^v(\d{6,})/$")


def tied_aliases(model: torch.nn.Module) -> frozenset[str]:
    """Names under which a parameter already named earlier appears again (lm_head.weight when the
    embeddings are tied). Computed from parameter identity, which FSDP's sharding keeps."""
    first: dict[int, str] = {}
    aliases = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases.add(name)
        else:
            first[id(parameter)] = name
    return frozenset(aliases)


def without_aliases(tensors: Mapping[str, torch.Tensor], aliases: frozenset[str]) -> dict[str, torch.Tensor]:
    """The tensors to publish: every one but the aliases, in the state dict's order."""
    return {name: tensor for name, tensor in tensors.items() if name not in aliases}


def served_tensors(tensors: Mapping[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """The tensors in the dtype the engines serve (None: as they are), on the CPU, converted once
    per version: the staged bytes, their deltas and the broadcast all carry it."""
    if dtype is None:
        return dict(tensors)
    target = torch_dtype(dtype)
    return {name: t.detach().to("cpu", target) if t.is_floating_point() else t for name, t in tensors.items()}


def version_prefix(run: str, version: int) -> str:
    """Object-key prefix of one version: <run>/v<version:06d>/."""
    return f"{run}/v{version:06d}/"


def manifest_uri(run: str, version: int) -> str:
    """s3:// URI of a version's manifest."""
    return objectstore.uri(topics.WEIGHTS_BUCKET, version_prefix(run, version) + MANIFEST_FILE)


@dataclass(frozen=True)
class StagedVersion:
    """A version that is durable in the object store: its manifest and where it lies."""

    run: str
    manifest: WeightManifest
    manifest_uri: str

    def shard_records(self) -> list[dict[str, Any]]:
        """The weight_version event's `shards` array."""
        prefix = version_prefix(self.run, self.manifest.version)
        return [
            {"uri": objectstore.uri(topics.WEIGHTS_BUCKET, prefix + s.file), "sha256": s.sha256, "size_bytes": s.size_bytes}
            for s in self.manifest.shards
        ]


def stage_version(
    mc: Minio,
    run: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    version: int,
    step: int,
    config: Mapping[str, Any],
    max_shard_bytes: int,
) -> StagedVersion:
    """Uploads the shards, then the manifest; returns once every object is stored.

    Re-staging a version (after a crash between staging and the event) overwrites it with the
    same names, so it stays consistent.
    """
    manifest, shards = encode_version(
        tensors, version=version, step=step, config=config, max_shard_bytes=max_shard_bytes
    )
    return put_version(mc, run, manifest, shards)


class VersionStager:
    """Stages each version full or as a delta on the previous one; holds the previous version's
    tensors (one CPU copy of the weights in the served dtype) and the chain of each version staged."""

    def __init__(self, mc: Minio, run: str, *, snapshot_interval: int, max_shard_bytes: int, zstd_level: int) -> None:
        self.mc, self.run = mc, run
        self.snapshot_interval, self.max_shard_bytes, self.zstd_level = snapshot_interval, max_shard_bytes, zstd_level
        self._previous: tuple[WeightManifest, dict[str, torch.Tensor]] | None = None
        self.chains: dict[int, tuple[int, ...]] = {}
        """Version -> its chain (snapshot..version), for the versions this stager staged."""

    def stage(self, tensors: Mapping[str, torch.Tensor], *, version: int, step: int,
              config: Mapping[str, Any]) -> StagedVersion:
        """Stages `version` (shards, then manifest) and keeps its tensors as the next one's base."""
        previous = self._previous
        as_delta = (previous is not None and previous[0].version == version - 1
                    and version % self.snapshot_interval != 0)
        held = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        manifest = shards = None
        if as_delta:
            base = previous[0]
            try:
                manifest, shards = delta.encode_delta(
                    previous[1], held, version=version, step=step, config=config,
                    base_chain=base.chain or (base.version,), max_shard_bytes=self.max_shard_bytes,
                    zstd_level=self.zstd_level)
            except ValueError:  # the tensors changed shape or dtype: only a full version can say so
                manifest = None
        if manifest is None:
            manifest, shards = encode_version(held, version=version, step=step, config=config,
                                              max_shard_bytes=self.max_shard_bytes)
        staged = put_version(self.mc, self.run, manifest, shards)
        # With every version full, holding a copy of the weights would buy nothing.
        self._previous = (manifest, held) if self.snapshot_interval > 1 else None
        self.chains[version] = manifest.chain or (version,)
        return staged

    def chains_of(self, versions: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """The chain of each staged version: known for what this stager staged, read once from the
        manifest for versions staged before a restart (one without a readable manifest, half-written
        or half-pruned, is its own chain: nothing can build on it)."""
        for version in versions:
            if version not in self.chains:
                try:
                    manifest = load_staged(self.mc, self.run, version).manifest
                    self.chains[version] = manifest.chain or (version,)
                except Exception:  # noqa: BLE001 - see the docstring; not cached, it may yet appear
                    continue
        return {v: self.chains.get(v, (v,)) for v in versions}


def put_version(mc: Minio, run: str, manifest: WeightManifest, shards: Mapping[str, bytes]) -> StagedVersion:
    """Uploads the shards, then the manifest (so a version whose manifest exists is complete)."""
    prefix = version_prefix(run, manifest.version)
    for file, data in shards.items():
        objectstore.put_bytes(mc, topics.WEIGHTS_BUCKET, prefix + file, data)
    objectstore.put_bytes(mc, topics.WEIGHTS_BUCKET, prefix + MANIFEST_FILE, manifest.to_json(), "application/json")
    return StagedVersion(run=run, manifest=manifest, manifest_uri=manifest_uri(run, manifest.version))


def load_staged(mc: Minio, run: str, version: int) -> StagedVersion:
    """Reads back the manifest of a version staged earlier (to re-announce it after a crash)."""
    data = objectstore.get_bytes(mc, topics.WEIGHTS_BUCKET, version_prefix(run, version) + MANIFEST_FILE)
    return StagedVersion(run=run, manifest=WeightManifest.from_json(data), manifest_uri=manifest_uri(run, version))


def weight_version_event(
    staged: StagedVersion, *, batch_id: str | None, broadcast_pools: Sequence[str], published_at_ms: int
) -> dict[str, Any]:
    """The `weights` event announcing a staged version (key: the run)."""
    return {
        "run": staged.run,
        "version": staged.manifest.version,
        "step": staged.manifest.step,
        "batch_id": batch_id,
        "manifest_uri": staged.manifest_uri,
        "shards": staged.shard_records(),
        "broadcast_pools": list(broadcast_pools),
        "published_at_ms": published_at_ms,
    }


def retained_versions(
    published: Iterable[int],
    *,
    keep_last: int,
    stale_step: int,
    keep_stale: int,
    checkpoint_versions: Iterable[int],
    chains: Mapping[int, Sequence[int]] | None = None,
) -> set[int]:
    """The published versions retention keeps (pure; see the module docstring).

    keep_last >= 1 always keeps the newest version, which engines must be able to load. `chains`
    maps a delta version to its chain (snapshot..version); a version not in it is full.
    """
    if keep_last < 1 or stale_step < 1 or keep_stale < 0:
        raise ValueError("keep_last and stale_step must be >= 1, keep_stale >= 0")
    ordered = sorted(set(published), reverse=True)
    newest = set(ordered[:keep_last])
    stale = set([v for v in ordered if v % stale_step == 0][:keep_stale])
    pinned = set(checkpoint_versions) & set(ordered)
    kept = newest | stale | pinned
    for version in list(kept):
        kept.update((chains or {}).get(version, ()))
    return kept & set(ordered)


def staged_versions(mc: Minio, run: str) -> list[int]:
    """Versions of `run` that have objects in the weights bucket, ascending."""
    found = []
    for obj in mc.list_objects(topics.WEIGHTS_BUCKET, prefix=f"{run}/", recursive=False):
        match = _VERSION_DIR.match(obj.object_name[len(run) + 1 :])
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def prune_versions(mc: Minio, run: str, keep: set[int]) -> list[int]:
    """Deletes every staged version of `run` not in `keep`; returns the versions deleted."""
    deleted = []
    for version in staged_versions(mc, run):
        if version in keep:
            continue
        prefix = version_prefix(run, version)
        # The manifest goes first, so a half-deleted version never looks complete to a reader.
        mc.remove_object(topics.WEIGHTS_BUCKET, prefix + MANIFEST_FILE)
        for obj in mc.list_objects(topics.WEIGHTS_BUCKET, prefix=prefix, recursive=True):
            mc.remove_object(topics.WEIGHTS_BUCKET, obj.object_name)
        deleted.append(version)
    return deleted
