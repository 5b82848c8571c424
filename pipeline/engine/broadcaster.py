"""The learner's side of the fast path: broadcast each new version to the engines of a pool.

Two-speed weight sync (ARCHITECTURE.md): the current pool receives every version, the stale pool every
`stale_step`-th. Each pool has its own weight-sync group (the learner is rank 0, the pool's
engines ranks 1..N), formed once on first use, because a collective needs every rank of its
group: the stale engines cannot sit in the current pool's group and skip versions.

Only the learner's rank 0 calls this. A pool whose broadcast fails is marked broken and skipped
from then on (a failed collective leaves its group in an unknown state); its engines lose
nothing, they load the same version from MinIO when the `weights` event announces it, because
the event lists only the pools that did receive the broadcast.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import SecretStr

from learner.broadcast import send_buckets
from learner.manifest import specs_of
from pipeline.engine.launch import free_port
from pipeline.engine.updates import EngineControl, weight_sync_group
from schemas.weight_layout import plan_buckets

log = logging.getLogger(__name__)


def _in_threads(calls: Sequence[Callable[[], Any]]) -> tuple[list[threading.Thread], list[Any]]:
    """Starts each call in a thread (the engines block in their side of the collective while this
    process sends); returns the threads and a list their results or exceptions land in."""
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except Exception as e:  # reported by the caller after join
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


@dataclass
class PoolBroadcaster:
    """Sends versions to every engine of one pool over one Gloo (CPU) or NCCL (GPU) group."""

    pool: str
    urls: Sequence[str]
    host: str
    port: int
    """Port of the group's rendezvous on `host`; 0 picks a free one when the group is formed (a port picked
    earlier can be taken meanwhile, e.g. as the local port of an outgoing connection)."""
    bucket_size_bytes: int
    backend: str = "gloo"
    timeout_s: float = 300.0
    join_timeout_s: float = 60.0
    """How long the group's rendezvous may take. An engine generates nothing while it waits to join, so
    when the learner's side fails (its port taken), the engine must give up soon, not after minutes."""
    api_key: SecretStr | None = field(default=None, repr=False)
    """The engines' API key (agent_loop.engine_api_key): their join and receive routes require it."""
    _group: Any = field(default=None, init=False, repr=False)
    _controls: list[EngineControl] = field(default_factory=list, init=False, repr=False)
    broken: str | None = field(default=None, init=False)

    def _engines(self) -> list[EngineControl]:
        """One control client per engine for the broadcaster's life (each holds its HTTP connections)."""
        if not self._controls:
            self._controls = [EngineControl(u, timeout_s=self.timeout_s, api_key=self.api_key) for u in self.urls]
        return self._controls

    def _connect(self) -> None:
        controls = self._engines()
        # Every rank must join or the rendezvous waits its whole timeout: an engine that is down
        # (killed, restarting) fails the pool now, and its engines load from MinIO instead.
        down = []
        for url, control in zip(self.urls, controls):
            try:
                control.state(timeout_s=10.0)
            except Exception as e:  # noqa: BLE001 (any failure to answer means down)
                down.append(f"{url}: {e!r}")
        if down:
            raise RuntimeError(f"engines of the {self.pool} pool do not answer: {'; '.join(down)}")
        world = len(self.urls) + 1
        port = self.port or free_port(self.host)
        threads, results = _in_threads([
            (lambda c=c, r=r: c.join(self.host, port, rank=r, world_size=world, backend=self.backend,
                                     timeout_s=self.join_timeout_s))
            for r, c in enumerate(controls, start=1)])
        try:
            self._group = weight_sync_group(self.host, port, rank=0, world_size=world, backend=self.backend,
                                            timeout_s=self.join_timeout_s)
        finally:  # the engines' joins end too (at most join_timeout_s) before the pool is given up
            for t in threads:
                t.join(self.join_timeout_s + 30.0)
        failed = [f"{u}: {r}" for u, r in zip(self.urls, results) if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"engines of the {self.pool} pool did not join: {'; '.join(failed)}")
        log.info("%s pool: weight-sync group of %d engines on %s:%d (%s)", self.pool, len(self.urls),
                 self.host, port, self.backend)

    def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Broadcasts `tensors` as `version` to every engine of the pool; returns when all have loaded it."""
        if self._group is None:
            self._connect()
        # Both sides plan the buckets from the same spec list in the same order: a different order
        # would be a collective size mismatch, which aborts the receiving worker.
        specs = specs_of(tensors)
        threads, results = _in_threads([
            (lambda c=c: c.receive(version, specs, self.bucket_size_bytes, src=0)) for c in self._engines()])
        send_buckets(tensors, plan_buckets(specs, self.bucket_size_bytes), src=0,
                     device=torch.device("cpu"), group=self._group)
        for t in threads:
            t.join(self.timeout_s)
        failed = [f"{u}: {r}" for u, r in zip(self.urls, results) if isinstance(r, Exception) or r is None]
        if failed:
            raise RuntimeError(f"version {version} not loaded by: {'; '.join(failed)}")


@dataclass
class EngineBroadcaster:
    """The learner's `broadcaster` hook (learner/process.py): returns the pools that got `version`."""

    current: PoolBroadcaster | None
    stale: PoolBroadcaster | None
    stale_step: int

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int) -> list[str]:
        # Engines start from the initial checkpoint: version 0 needs no broadcast, but the first
        # call is where the groups are formed, so it is sent like any other.
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        pools = []
        targets = [self.current] + ([self.stale] if version % self.stale_step == 0 else [])
        for target in targets:
            if target is None or target.broken:
                continue
            try:
                target.send(cpu, version)
                pools.append(target.pool)
            except Exception as e:
                target.broken = str(e)
                log.error("broadcast of version %d to the %s pool failed, its engines will load it from "
                          "MinIO from now on: %s", version, target.pool, e)
        return pools
