"""The learner's broadcast to a pool whose engine is down: the pool fails at once and is marked
broken (its engines load from MinIO), instead of the learner waiting out the rendezvous timeout
for a rank that will never join (seen when an engine was restarted on another port)."""

from __future__ import annotations

import time

import torch

from pipeline.engine.broadcaster import EngineBroadcaster, PoolBroadcaster
from pipeline.engine.launch import free_port


def test_a_pool_with_an_engine_down_is_broken_at_once_and_later_versions_skip_it():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    stale = PoolBroadcaster("stale", [dead], "127.0.0.1", free_port(), bucket_size_bytes=1 << 20, timeout_s=300)
    broadcast = EngineBroadcaster(current=None, stale=stale, stale_step=1)
    started = time.monotonic()
    assert broadcast({"w": torch.zeros(2)}, version=1) == []
    assert time.monotonic() - started < 30
    assert stale.broken is not None and "do not answer" in stale.broken and dead in stale.broken
    assert broadcast({"w": torch.zeros(2)}, version=2) == []
