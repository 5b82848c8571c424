"""Delta versions through the real MinIO: the learner's stager (learner/publish.py) stages a chain of
versions taken by real optimizer steps, and an engine's download (pipeline/engine/updates.py)
rebuilds any of them bit for bit, whether it holds the version before, nothing (a late joiner, a
restarted engine), or a version of an older chain; a corrupted delta is refused, and retention
keeps every version a kept delta is built on. The engine itself loads such a rebuilt directory
as any other version (tests/integration/test_engine_updates.py)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.manifest import ShardIntegrityError, read_version, tensor_sha256
from learner.publish import (
    VersionStager,
    prune_versions,
    retained_versions,
    served_tensors,
    staged_versions,
    tied_aliases,
    weight_version_event,
    without_aliases,
)
from pipeline.engine.updates import download_version
from schemas import objectstore, topics

pytestmark = pytest.mark.integration


def _versions(count: int, lr: float = 1e-6) -> list[dict[str, torch.Tensor]]:
    """`count` versions of a tiny tied-embedding policy, one AdamW step apart, in bfloat16 as served."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         vocab_size=300, tie_word_embeddings=True))
    aliases = tied_aliases(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for _ in range(count):
        out.append(served_tensors(without_aliases(model.state_dict(), aliases), "bfloat16"))
        out[-1] = {k: v.clone() for k, v in out[-1].items()}
        ids = torch.randint(0, 300, (2, 16))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return out


def _stage_all(mc, run: str, versions: list[dict[str, torch.Tensor]], interval: int) -> tuple[VersionStager, list[dict]]:
    stager = VersionStager(mc, run, snapshot_interval=interval, max_shard_bytes=64 * 1024, zstd_level=3)
    events = [weight_version_event(stager.stage(t, version=v, step=v, config={"model_type": "qwen2"}), batch_id=None,
                                   broadcast_pools=[], published_at_ms=0) for v, t in enumerate(versions)]
    return stager, events


def _assert_bit_identical(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    _, tensors = read_version(directory)
    assert list(tensors) == list(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and tensor_sha256(tensors[name]) == tensor_sha256(tensor), name


@pytest.fixture(scope="module")
def mc(infra):
    return objectstore.client(infra.object_store)


@pytest.fixture(scope="module")
def versions() -> list[dict[str, torch.Tensor]]:
    return _versions(13)


def test_a_late_joining_engine_catches_up_through_a_ten_version_chain_bit_for_bit(mc, versions, tmp_path):
    run = f"delta-{uuid.uuid4().hex[:8]}"
    _, events = _stage_all(mc, run, versions[:11], interval=100)
    assert events[10]["shards"] and all("delta-" in s["uri"] for s in events[10]["shards"])
    full = sum(s["size_bytes"] for s in events[0]["shards"])
    delta = sum(s["size_bytes"] for s in events[10]["shards"])
    assert delta < 0.1 * full, (delta, full)  # lr 1e-6 in bfloat16: most weights keep their bits

    manifest = download_version(mc, events[10], tmp_path / "engine" / "v000010")
    assert (manifest.version, manifest.kind) == (10, "full")  # rebuilt: a full version directory
    _assert_bit_identical(tmp_path / "engine" / "v000010", versions[10])


def test_an_engine_following_the_chain_applies_each_delta_on_the_version_it_holds(mc, versions, tmp_path):
    run = f"delta-{uuid.uuid4().hex[:8]}"
    _, events = _stage_all(mc, run, versions[:6], interval=100)
    root = tmp_path / "engine"
    download_version(mc, events[0], root / "v000000")
    # From here on the snapshot is gone from the store: only the held version can be the base.
    prune_versions(mc, run, keep={1, 2, 3, 4, 5})
    for version in range(1, 6):
        directory = root / f"v{version:06d}"
        download_version(mc, events[version], directory)
        _assert_bit_identical(directory, versions[version])
        shutil.rmtree(root / f"v{version - 1:06d}")  # as the supervisor keeps only what it serves


def test_an_engine_restarted_mid_chain_or_on_an_older_chain_starts_from_the_snapshot(mc, versions, tmp_path):
    run = f"delta-{uuid.uuid4().hex[:8]}"
    _, events = _stage_all(mc, run, versions, interval=5)  # snapshots 0, 5, 10
    root = tmp_path / "engine"
    download_version(mc, events[3], root / "v000003")  # held before the restart, chain 0..3
    download_version(mc, events[12], root / "v000012")  # 3 is not in 10..12: snapshot 10, then 11, 12
    _assert_bit_identical(root / "v000012", versions[12])

    # A held directory that no longer verifies (damaged while the engine was down) is dropped for the snapshot.
    shutil.rmtree(root / "v000012")
    download_version(mc, events[11], root / "v000011")
    shard = next((root / "v000011").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    download_version(mc, events[12], root / "v000012")
    _assert_bit_identical(root / "v000012", versions[12])


def test_a_corrupted_delta_in_the_store_is_refused_and_nothing_is_written(mc, versions, tmp_path):
    run = f"delta-{uuid.uuid4().hex[:8]}"
    _, events = _stage_all(mc, run, versions[:4], interval=100)
    bucket, key = objectstore.parse_uri(events[2]["shards"][0]["uri"])
    data = bytearray(objectstore.get_bytes(mc, bucket, key))
    data[-1] ^= 0xFF
    objectstore.put_bytes(mc, bucket, key, bytes(data))
    root = tmp_path / "engine"
    download_version(mc, events[1], root / "v000001")
    with pytest.raises(ShardIntegrityError, match="sha256"):
        download_version(mc, events[3], root / "v000003")  # held 1, then 2 (corrupted), then 3
    assert not (root / "v000003").exists()
    with pytest.raises(ShardIntegrityError, match="sha256"):
        download_version(mc, events[3], tmp_path / "late" / "v000003")  # from the snapshot: the same refusal


def test_retention_keeps_every_version_a_kept_delta_needs_and_the_newest_still_loads(mc, versions, tmp_path):
    run = f"delta-{uuid.uuid4().hex[:8]}"
    stager, events = _stage_all(mc, run, versions, interval=5)
    staged = staged_versions(mc, run)
    keep = retained_versions(staged, keep_last=2, stale_step=4, keep_stale=1, checkpoint_versions=[7],
                             chains=stager.chains_of(staged))
    # newest 11, 12 (chain 10..12); stale 12; checkpoint 7 (chain 5..7)
    assert keep == {10, 11, 12, 5, 6, 7}
    prune_versions(mc, run, keep)
    assert staged_versions(mc, run) == [5, 6, 7, 10, 11, 12]
    # A restarted learner reads the chains back from the manifests.
    restarted = VersionStager(mc, run, snapshot_interval=5, max_shard_bytes=1 << 20, zstd_level=3)
    assert restarted.chains_of([7, 12]) == {7: (5, 6, 7), 12: (10, 11, 12)}
    for version in (7, 12):
        download_version(mc, events[version], tmp_path / f"late-{version}" / f"v{version:06d}")
        _assert_bit_identical(tmp_path / f"late-{version}" / f"v{version:06d}", versions[version])
    assert topics.WEIGHTS_BUCKET in events[12]["manifest_uri"]
