"""`rollstream bench weights`, scaled down: two learner steps per setting on the default policy, staged as
deltas in the real MinIO, rebuilt by a late joiner and followed by a real engine (the full run:
`rollstream bench weights --model random-0.5b`, BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_scaled_down_bench_weights_stages_deltas_that_a_late_joiner_and_an_engine_rebuild_exactly(infra):
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "weights", "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    settings = {(s["dtype"], s["lr"]): s for s in report["settings"]}
    assert set(settings) == {(d, lr) for d in ("bfloat16", "float32") for lr in (1e-6, 1e-4)}
    for setting in settings.values():
        kinds = [v["kind"] for v in setting["versions"]]
        assert kinds == ["full", "delta", "delta"]
        assert setting["late_join"] == {**setting["late_join"], "version": 2, "chain_length": 3, "bit_identical": True}
        assert 0 < setting["delta_fraction"] < 1
    # At AgentRL's learning rate few bf16 bytes change: the delta is a small part of the version.
    assert settings[("bfloat16", 1e-6)]["delta_fraction"] < settings[("bfloat16", 1e-4)]["delta_fraction"]
    update = report["update"]
    assert len(update["served_s"]) == 1 and update["first_s"] > 0  # version 1 from the snapshot, version 2 followed
    assert report["ratio"] == update["ratio"] > 0
    # version 2 was applied in memory on the version the worker held, and the engine's log said where its time went
    assert [row["version"] for row in update["engine_split"]][-1:] == [2], update["engine_split"]
    assert update["baseline"]["bytes"] == settings[("bfloat16", 1e-6)]["versions"][0]["full_bytes"]
