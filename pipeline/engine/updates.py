"""Weight updates of an engine: which versions a pool loads, the staged path from MinIO, the
weight-sync process group both sides of a broadcast join, and the client of the engine's
`/rollstream/*` control surface (pipeline/engine/server.py).

Staged path: `download_version` fetches the manifest named by a `weights` event, then each shard,
and checks every shard's size and sha256 against the manifest (and the event's own hash) before
writing it; a mismatch raises `ShardIntegrityError` and nothing reaches the engine. The engine's
worker verifies the directory once more when it reads it (learner/manifest.py `read_version`),
so a shard corrupted on local disk is refused too.

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
import torch.distributed as dist
from minio import Minio

from learner.manifest import ShardIntegrityError, verify_shard
from schemas import objectstore
from schemas.weight_layout import MANIFEST_FILE, TensorSpec, WeightManifest


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


def download_version(mc: Minio, event: dict[str, Any], directory: Path) -> WeightManifest:
    """Downloads the version of a `weight_version` event into `directory`, verifying every shard
    against the manifest before writing it; the manifest is written last (a directory with a
    manifest is complete). Raises ShardIntegrityError on any mismatch."""
    bucket, manifest_key = objectstore.parse_uri(event["manifest_uri"])
    manifest = WeightManifest.from_json(objectstore.get_bytes(mc, bucket, manifest_key))
    if manifest.version != event["version"]:
        raise ShardIntegrityError(f"manifest {event['manifest_uri']} is version {manifest.version}, "
                                  f"the event says {event['version']}")
    announced = {objectstore.parse_uri(s["uri"])[1].rsplit("/", 1)[-1]: s["sha256"] for s in event["shards"]}
    prefix = manifest_key.rsplit("/", 1)[0] + "/" if "/" in manifest_key else ""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in manifest.shards:
        if entry.file in announced and announced[entry.file] != entry.sha256:
            raise ShardIntegrityError(f"shard {entry.file}: the event's sha256 differs from the manifest's")
        data = objectstore.get_bytes(mc, bucket, prefix + entry.file)
        verify_shard(entry, data)
        (directory / entry.file).write_bytes(data)
    (directory / MANIFEST_FILE).write_bytes(manifest.to_json())
    return manifest


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

    def __init__(self, base_url: str, *, timeout_s: float = 900.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        payload = response.json()
        if response.status_code != 200:
            raise UpdateRefused(payload.get("error", response.text))
        return payload

    def state(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """{"version", "updating", "in_flight", "last_error", "busy", "busy_for_s"} (server.UpdateState.snapshot)."""
        response = httpx.get(f"{self.base_url}/rollstream/state", timeout=timeout_s)
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

    def receive(self, version: int, specs: Sequence[TensorSpec], bucket_size_bytes: int, *, src: int = 0) -> dict[str, Any]:
        """Receives `version` by broadcast from group rank `src` (the sender calls send_buckets
        with the same specs and bucket size) and loads it."""
        return self._post("/rollstream/receive", {
            "version": version, "specs": [s.model_dump(mode="json") for s in specs],
            "bucket_size_bytes": bucket_size_bytes, "src": src})
