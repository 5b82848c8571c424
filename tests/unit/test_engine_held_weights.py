"""The engine worker's in-memory delta path (pipeline/engine/extension.py): after loading a version
directory the worker holds its tensors, applies downloaded delta links on them and loads the result
bit for bit; it refuses, loading nothing, a delta on another version, a corrupted delta, and any
delta when it holds nothing (at start-up, after a broadcast, or with holding turned off). The worker
here is the extension with a recording `reload_weights` in place of vLLM's; the real engine is
exercised by tests/integration/test_engine_updates.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from learner.delta import encode_delta
from learner.manifest import tensor_sha256, write_version
from pipeline.engine.extension import HOLD_WEIGHTS_ENV, WeightUpdateExtension
from pipeline.engine.updates import write_delta_link


class RecordingWorker(WeightUpdateExtension):
    """The extension on a worker whose reload_weights records what it was given."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.reloads = 0
        self.model_runner = SimpleNamespace(model=SimpleNamespace(),
                                            model_config=SimpleNamespace(hf_text_config=SimpleNamespace()))

    def reload_weights(self, weights_iterator) -> None:
        self.reloads += 1
        self.loaded = {name: tensor.clone() for name, tensor in weights_iterator}


def _versions(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` versions in bfloat16, each a small step from the one before (one tensor never moves)."""
    generator = torch.Generator().manual_seed(0)
    version = {"a": torch.randn(32, 16, generator=generator).bfloat16(),
               "b": torch.randn(16, generator=generator).bfloat16(),
               "frozen": torch.randn(8, 8, generator=generator).bfloat16()}
    out = [version]
    for _ in range(count - 1):
        version = {name: (t if name == "frozen" else (t.float() * (1 + 0.05 * torch.randn(t.shape, generator=generator))).bfloat16())
                   for name, t in version.items()}
        out.append(version)
    return out


def _stage(tmp_path: Path, versions: list[dict[str, torch.Tensor]]) -> tuple[Path, list[Path]]:
    """Version 0 as a full directory and versions 1.. as delta link directories."""
    full = tmp_path / "v000000"
    write_version(full, versions[0], version=0, step=0, config={}, max_shard_bytes=1 << 20)
    links, chain = [], (0,)
    for v in range(1, len(versions)):
        manifest, shards = encode_delta(versions[v - 1], versions[v], version=v, step=v, config={}, base_chain=chain,
                                        max_shard_bytes=1 << 20, zstd_level=3)
        chain = manifest.chain
        links.append(tmp_path / f"v{v:06d}.delta")
        write_delta_link(links[-1], manifest, shards)
    return full, links


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in tensors.items()}


def test_a_worker_applies_a_chain_of_deltas_on_the_version_it_loaded_bit_for_bit(tmp_path):
    versions = _versions(4)
    full, links = _stage(tmp_path, versions)
    worker = RecordingWorker()
    assert worker.rollstream_load_dir(str(full))["ok"]
    result = worker.rollstream_apply_deltas([str(links[0])])
    assert result["ok"] and result["version"] == 1 and result["deltas"] == 1
    assert _digests(worker.loaded) == _digests(versions[1])
    # Two links at once (an engine that skipped a version), on the version applied in memory.
    result = worker.rollstream_apply_deltas([str(p) for p in links[1:]])
    assert result["ok"] and result["version"] == 3 and result["deltas"] == 2
    assert _digests(worker.loaded) == _digests(versions[3])
    assert worker.reloads == 3


def test_a_delta_on_another_version_is_refused_and_nothing_is_loaded(tmp_path):
    full, links = _stage(tmp_path, _versions(3))
    worker = RecordingWorker()
    worker.rollstream_load_dir(str(full))
    result = worker.rollstream_apply_deltas([str(links[1])])  # version 2 on 1, the worker holds 0
    assert not result["ok"] and result["held_version"] == 0
    assert "the first delta is on version 1, this worker holds version 0" in result["error"]
    assert worker.reloads == 1


def test_a_corrupted_delta_is_refused_and_the_held_version_stays(tmp_path):
    versions = _versions(2)
    full, links = _stage(tmp_path, versions)
    shard = next(links[0].glob("delta-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    worker = RecordingWorker()
    worker.rollstream_load_dir(str(full))
    result = worker.rollstream_apply_deltas([str(links[0])])
    assert not result["ok"] and "sha256" in result["error"] and result["held_version"] == 0
    assert worker.reloads == 1 and _digests(worker.loaded) == _digests(versions[0])


@pytest.mark.parametrize("how", ["nothing loaded yet", "holding turned off"])
def test_a_worker_that_holds_nothing_refuses_a_delta(tmp_path, monkeypatch, how):
    full, links = _stage(tmp_path, _versions(2))
    worker = RecordingWorker()
    if how == "holding turned off":
        monkeypatch.setenv(HOLD_WEIGHTS_ENV, "0")
        assert worker.rollstream_load_dir(str(full))["ok"]
    result = worker.rollstream_apply_deltas([str(links[0])])
    assert not result["ok"] and result["held_version"] is None
    assert "holds no weights" in result["error"]
