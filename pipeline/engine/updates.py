"""Weight updates of an engine: which versions a pool loads, the staged path from MinIO, the
weight-sync process group both sides of a broadcast join, and the client of the engine's
`/rollstream/*` control surface (pipeline/engine/server.py).

Staged path: `download_version` fetches the manifest named by a `weights` event, then each shard,
and checks every shard's size and sha256 against the manifest (and the event's own hash) before
writing it; a mismatch raises `ShardIntegrityError` and nothing reaches the engine. The engine's
worker verifies the directory once more when it reads it (learner/manifest.py `read_version`),
so a shard corrupted on local disk is refused too.

A delta version (learner/delta.py) is rebuilt here, before the engine sees it: on top of the
version this engine last downloaded (the supervisor keeps that directory beside the new one) when
it is in the version's chain, else from the chain's full snapshot in MinIO (an engine that holds
nothing, was loaded by broadcast, restarted, or is too far behind), then every delta of the chain
in order. Each result tensor must have the sha256 its manifest names, or the version is refused
(`ShardIntegrityError`, the same refusal as a corrupted shard) and the engine keeps serving what it
had; a local base that fails its checks is dropped for the snapshot path first. The rebuilt
version is written as a full version directory, which the worker loads as any other.

In-memory path (the default, `EngineSettings.hold_weights`): the engine's worker keeps the tensors of
the version it serves from MinIO (pipeline/engine/extension.py). When the new version's chain holds
the served version, `download_links` fetches only the deltas after it, checks their shards and
writes each as a small `vNNNNNN.delta` directory; the worker applies them on the tensors it holds,
checks every result tensor's sha256 and loads the result. Nothing of the size of the model is read,
written or sent between processes. Any refusal there (the worker holds another version, or nothing)
falls back to the rebuild above.

Fast path: the learner is rank 0 of a dedicated group, each engine worker one more rank.
vLLM owns the default torch.distributed group inside its workers (and torchrun owns it in the
learner), so the weight-sync group is a *stateless* group (vLLM's
`stateless_init_torch_distributed_process_group`), registered with c10d so that the plain
`torch.distributed.broadcast(..., group=g)` of learner/broadcast.py accepts it, with `src` given
as the group rank. Both sides call `weight_sync_group` with the same host, port and world size.

Example (learner side, with one engine at http://127.0.0.1:8000):

    control = EngineControl("http://127.0.0.1:8000")
    # in a thread: control.join(host, port, rank=1, world_size=2)
    group = weight_sync_group(host, port, rank=0, world_size=2, backend="gloo")
    # in a thread: control.receive(version, specs, bucket_size_bytes, src=0)
    send_buckets(tensors, plan_buckets(specs, bucket_size_bytes), src=0, device=cpu, group=group)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
from minio import Minio
from pydantic import SecretStr

from env_workers.engine_client import auth_headers

from learner.delta import apply_delta, catch_up_plan
from learner.manifest import ShardIntegrityError, decode_version, read_version, verify_shard, write_version
from schemas import objectstore
from schemas.weight_layout import MANIFEST_FILE, TensorSpec, WeightManifest

# Shard size of a version directory rebuilt from a delta chain (local disk only: one shard is fine).
REBUILT_SHARD_BYTES = 4 * 1024**3
# A downloaded delta link's directory: vNNNNNN.delta beside the full version directories.
DELTA_DIR_SUFFIX = ".delta"


def should_load(pool: str, version: int, loaded_version: int, stale_step: int) -> bool:
    """Whether an engine of `pool` serving `loaded_version` loads `version`: the current pool
    takes every newer version, the stale pool only every `stale_step`-th (AgentRL's stale
    engines, refreshed every 25 learner versions)."""
    if version <= loaded_version:
        return False
    return pool == "current" or version % stale_step == 0


def newest_to_load(pool: str, versions: Sequence[int], loaded_version: int, stale_step: int) -> int | None:
    """Of the versions announced since the last look, the newest one this engine loads (loading
    older ones first would only be overwritten), or None."""
    wanted = [v for v in versions if should_load(pool, v, loaded_version, stale_step)]
    return max(wanted) if wanted else None


def _event_manifest(mc: Minio, event: dict[str, Any]) -> tuple[str, str, WeightManifest]:
    """(bucket, manifest key, manifest) of a `weight_version` event, the manifest checked against the event."""
    bucket, manifest_key = objectstore.parse_uri(event["manifest_uri"])
    manifest = WeightManifest.from_json(objectstore.get_bytes(mc, bucket, manifest_key))
    if manifest.version != event["version"]:
        raise ShardIntegrityError(f"manifest {event['manifest_uri']} is version {manifest.version}, "
                                  f"the event says {event['version']}")
    announced = {objectstore.parse_uri(s["uri"])[1].rsplit("/", 1)[-1]: s["sha256"] for s in event["shards"]}
    for entry in manifest.shards:
        if entry.file in announced and announced[entry.file] != entry.sha256:
            raise ShardIntegrityError(f"shard {entry.file}: the event's sha256 differs from the manifest's")
    return bucket, manifest_key, manifest


def download_version(mc: Minio, event: dict[str, Any], directory: Path) -> WeightManifest:
    """Downloads the version of a `weight_version` event into `directory`, verifying every shard
    against the manifest before writing it; the manifest is written last (a directory with a
    manifest is complete). A delta version is rebuilt on its chain first (module docstring), from
    the newest version directory beside `directory` that is in its chain, if any. Raises
    ShardIntegrityError on any mismatch."""
    bucket, manifest_key, manifest = _event_manifest(mc, event)
    if manifest.kind == "delta":
        tensors, checksums = rebuild_version(mc, bucket, _run_prefix(manifest_key), manifest,
                                             held_versions(directory.parent, exclude=directory))
        return write_version(directory, tensors, version=manifest.version, step=manifest.step, config=manifest.config,
                             max_shard_bytes=REBUILT_SHARD_BYTES, checksums=checksums)
    prefix = manifest_key.rsplit("/", 1)[0] + "/" if "/" in manifest_key else ""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in manifest.shards:
        data = objectstore.get_bytes(mc, bucket, prefix + entry.file)
        verify_shard(entry, data)
        (directory / entry.file).write_bytes(data)
    (directory / MANIFEST_FILE).write_bytes(manifest.to_json())
    return manifest


def download_links(mc: Minio, event: dict[str, Any], served_version: int, root: Path) -> list[Path] | None:
    """The deltas that take an engine serving `served_version` to the event's version, each
    downloaded with its shards checked into `root`/vNNNNNN.delta (manifest last), oldest first; None
    when the event's version is not a delta on a chain that holds `served_version` (the engine then
    needs `download_version`). Raises ShardIntegrityError on any mismatch."""
    bucket, manifest_key, manifest = _event_manifest(mc, event)
    if manifest.kind != "delta" or served_version not in manifest.chain[:-1]:
        return None
    run_prefix = _run_prefix(manifest_key)
    directories = []
    for version in catch_up_plan(manifest.chain, served_version)[1]:
        if version == manifest.version:
            link, prefix = manifest, manifest_key.rsplit("/", 1)[0] + "/"
        else:
            link, prefix = _fetch_manifest(mc, bucket, run_prefix, version)
        if link.kind != "delta" or link.base_version != version - 1:
            raise ShardIntegrityError(f"version {version} of chain {manifest.chain} is not a delta on version {version - 1}")
        directory = root / f"v{version:06d}{DELTA_DIR_SUFFIX}"
        write_delta_link(directory, link, _fetch_shards(mc, bucket, prefix, link))
        directories.append(directory)
    return directories


def write_delta_link(directory: Path, manifest: WeightManifest, shards: dict[str, bytes]) -> None:
    """One delta version as a directory: its shards, then its manifest (a directory with a manifest is complete)."""
    directory.mkdir(parents=True, exist_ok=True)
    for file, data in shards.items():
        (directory / file).write_bytes(data)
    (directory / MANIFEST_FILE).write_bytes(manifest.to_json())


def read_delta_link(directory: Path) -> tuple[WeightManifest, dict[str, bytes]]:
    """A directory of `write_delta_link`: (manifest, {shard file: bytes}); `apply_delta` checks the shards."""
    manifest = WeightManifest.from_json((directory / MANIFEST_FILE).read_bytes())
    if manifest.kind != "delta":
        raise ShardIntegrityError(f"{directory} holds a {manifest.kind} version, not a delta")
    shards = {}
    for entry in manifest.shards:
        try:
            shards[entry.file] = (directory / entry.file).read_bytes()
        except OSError as error:
            raise ShardIntegrityError(f"delta shard {entry.file} of version {manifest.version}: {error}") from None
    return manifest, shards


def _run_prefix(manifest_key: str) -> str:
    """<run>/v000005/manifest.json -> <run>/"""
    parts = manifest_key.rsplit("/", 2)
    return parts[0] + "/" if len(parts) == 3 else ""


def held_versions(root: Path, *, exclude: Path | None = None) -> dict[int, Path]:
    """The complete version directories under `root` (those with a manifest), by version."""
    found = {}
    for manifest_path in root.glob(f"v*/{MANIFEST_FILE}"):
        if exclude is not None and manifest_path.parent == exclude:
            continue
        try:
            manifest = WeightManifest.from_json(manifest_path.read_bytes())
        except (OSError, ValueError):  # unreadable: as if absent
            continue
        if manifest.kind == "full":  # a vNNNNNN.delta directory is a link, not a version to build on
            found[manifest.version] = manifest_path.parent
    return found


def _fetch_shards(mc: Minio, bucket: str, prefix: str, manifest: WeightManifest) -> dict[str, bytes]:
    shards = {}
    for entry in manifest.shards:
        data = objectstore.get_bytes(mc, bucket, prefix + entry.file)
        verify_shard(entry, data)
        shards[entry.file] = data
    return shards


def _fetch_manifest(mc: Minio, bucket: str, run_prefix: str, version: int) -> tuple[WeightManifest, str]:
    prefix = f"{run_prefix}v{version:06d}/"
    manifest = WeightManifest.from_json(objectstore.get_bytes(mc, bucket, prefix + MANIFEST_FILE))
    if manifest.version != version:
        raise ShardIntegrityError(f"{prefix}{MANIFEST_FILE} is version {manifest.version}, expected {version}")
    return manifest, prefix


def rebuild_version(mc: Minio, bucket: str, run_prefix: str, manifest: WeightManifest,
                    held: dict[int, Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (and their sha256) of the delta version `manifest`, built on the newest `held`
    version directory of its chain, or on its snapshot from the store when none is (or when the
    held one fails a check). Raises ShardIntegrityError when the store's chain does not verify."""
    local = max((v for v in held if v in manifest.chain and v < manifest.version), default=None)
    for base in ([local] if local is not None else []) + [None]:
        start, deltas = catch_up_plan(manifest.chain, base)
        try:
            if start is None:
                base_manifest, tensors = read_version(held[base])
            else:
                base_manifest, prefix = _fetch_manifest(mc, bucket, run_prefix, start)
                if base_manifest.kind != "full":
                    raise ShardIntegrityError(f"version {start}, the snapshot of chain {manifest.chain}, is a delta")
                tensors = decode_version(base_manifest, _fetch_shards(mc, bucket, prefix, base_manifest))
            checksums = {t.name: t.sha256 for t in base_manifest.tensors if t.sha256 is not None}
            for version in deltas:
                if version == manifest.version:
                    link, prefix = manifest, f"{run_prefix}v{version:06d}/"
                else:
                    link, prefix = _fetch_manifest(mc, bucket, run_prefix, version)
                if link.kind != "delta" or link.base_version != version - 1:
                    raise ShardIntegrityError(f"version {version} of chain {manifest.chain} is not a delta on "
                                              f"version {version - 1}")
                tensors, checksums = apply_delta(tensors, link, _fetch_shards(mc, bucket, prefix, link),
                                                 base_checksums=checksums)
            return tensors, checksums
        except ShardIntegrityError:
            if start is not None:
                raise
            # The local copy no longer verifies (or was another chain's): the snapshot path decides.
    raise AssertionError("unreachable: the snapshot path returns or raises")


def manifest_digest(manifest: WeightManifest) -> str:
    """Short id of a manifest, for logs."""
    return hashlib.sha256(manifest.to_json()).hexdigest()[:12]


def weight_sync_group(host: str, port: int, *, rank: int, world_size: int, backend: str,
                      timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Joins the learner-engines weight-sync group (rank 0 = the learner, hosting the store at
    host:port); blocks until all `world_size` ranks have joined."""
    # Imported here: vLLM is heavy and only the two ends of a broadcast need it.
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend, timeout=timedelta(seconds=timeout_s))
    # c10d maps a global rank to the group's rank through this table; the group's ranks are its
    # own here, so the identity map lets torch.distributed.broadcast(src=group rank) accept it.
    dist.distributed_c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


class UpdateRefused(RuntimeError):
    """The engine refused or failed a weight update; it keeps serving the version it had."""


class EngineControl:
    """Client of one engine's /rollstream/* control surface (synchronous; calls block until the
    update is done, which includes draining the requests in flight)."""

    def __init__(self, base_url: str, *, timeout_s: float = 900.0, api_key: SecretStr | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)  # the engine's key (agent_loop.engine_api_key), when it has one
        # One client for the control's life: httpx.post() makes a client, and with it an SSL context that loads
        # the CA bundle, on every call (17 ms of CPU here, py-spy of an engine's supervisor).
        self._client = httpx.Client(headers=self.headers)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._client.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        payload = response.json()
        if response.status_code != 200:
            raise UpdateRefused(payload.get("error", response.text))
        return payload

    def state(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """{"version", "updating", "in_flight", "last_error", "busy", "busy_for_s"} (server.UpdateState.snapshot)."""
        response = self._client.get(f"{self.base_url}/rollstream/state", timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    def load(self, version: int, directory: Path) -> dict[str, Any]:
        """Loads a verified version directory (staged path)."""
        return self._post("/rollstream/load", {"version": version, "path": str(directory)})

    def join(self, host: str, port: int, *, rank: int, world_size: int, backend: str = "gloo",
             timeout_s: float = 300.0) -> dict[str, Any]:
        """Makes the engine's worker join the weight-sync group as `rank`, waiting at most `timeout_s`
        for the other ranks (the engine generates nothing meanwhile)."""
        return self._post("/rollstream/join", {"host": host, "port": port, "rank": rank,
                                               "world_size": world_size, "backend": backend, "timeout_s": timeout_s})

    def apply_deltas(self, version: int, directories: Sequence[Path]) -> dict[str, Any]:
        """Applies downloaded delta links (`download_links`) on the version the engine's worker holds,
        oldest first, and loads the result (in-memory path); refused when the worker holds another version."""
        return self._post("/rollstream/apply", {"version": version, "paths": [str(d) for d in directories]})

    def receive(self, version: int, specs: Sequence[TensorSpec], bucket_size_bytes: int, *, src: int = 0) -> dict[str, Any]:
        """Receives `version` by broadcast from group rank `src` (the sender calls send_buckets
        with the same specs and bucket size) and loads it."""
        return self._post("/rollstream/receive", {
            "version": version, "specs": [s.model_dump(mode="json") for s in specs],
            "bucket_size_bytes": bucket_size_bytes, "src": src})
