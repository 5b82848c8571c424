"""Staged weights: safetensors shards plus a manifest, round trip and integrity checks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.manifest import ShardIntegrityError, decode_version, encode_version, read_version, write_version
from schemas.weight_layout import MANIFEST_FILE, WeightManifest


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=64,
        tie_word_embeddings=True,  # lm_head shares the embedding's storage
    )
    return Qwen2ForCausalLM(config)


def config_of(model) -> dict:
    return json.loads(model.config.to_json_string())


def test_version_round_trips_through_a_directory_in_several_shards(model, tmp_path):
    state = model.state_dict()
    manifest = write_version(tmp_path, state, version=3, step=3, config=config_of(model), max_shard_bytes=20_000)
    assert len(manifest.shards) > 1
    assert (tmp_path / MANIFEST_FILE).exists()

    read_manifest, tensors = read_version(tmp_path)
    assert read_manifest == manifest
    assert (read_manifest.version, read_manifest.step) == (3, 3)
    assert read_manifest.config["hidden_size"] == 64
    assert list(tensors) == list(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
    rebuilt = Qwen2ForCausalLM(Qwen2Config(**read_manifest.config))
    rebuilt.load_state_dict(tensors)


def test_shards_respect_the_max_size_unless_one_tensor_is_larger(model):
    state = model.state_dict()
    manifest, shards = encode_version(state, version=1, step=1, config={}, max_shard_bytes=30_000)
    by_shard: dict[str, int] = {}
    for t in manifest.tensors:
        by_shard[t.shard] = by_shard.get(t.shard, 0) + state[t.name].numel() * state[t.name].element_size()
    biggest = max(t.numel() * t.element_size() for t in state.values())
    for shard, nbytes in by_shard.items():
        assert nbytes <= max(30_000, biggest), shard
    assert set(shards) == {s.file for s in manifest.shards}


def test_sha256_mismatch_is_a_clear_error(model):
    manifest, shards = encode_version(model.state_dict(), version=1, step=1, config={}, max_shard_bytes=50_000)
    first = manifest.shards[0].file
    corrupted = bytearray(shards[first])
    corrupted[-1] ^= 0xFF
    with pytest.raises(ShardIntegrityError, match=f"shard {first}: sha256 .* does not match"):
        decode_version(manifest, dict(shards, **{first: bytes(corrupted)}))


def test_truncated_or_missing_shard_is_rejected(model, tmp_path):
    manifest = write_version(tmp_path, model.state_dict(), version=1, step=1, config={}, max_shard_bytes=50_000)
    last = tmp_path / manifest.shards[-1].file
    last.write_bytes(last.read_bytes()[:-10])
    with pytest.raises(ShardIntegrityError, match="bytes, manifest says"):
        read_version(tmp_path)
    last.unlink()
    with pytest.raises(ShardIntegrityError, match="missing"):
        read_version(tmp_path)


def test_manifest_json_is_canonical_and_checks_its_format(model):
    manifest, _ = encode_version(model.state_dict(), version=2, step=2, config={"a": 1}, max_shard_bytes=1 << 20)
    data = manifest.to_json()
    assert WeightManifest.from_json(data) == manifest
    assert WeightManifest.from_json(data).to_json() == data
    wrong = json.loads(data)
    wrong["format"] = "something/else"
    with pytest.raises(ValueError, match="unknown manifest format"):
        WeightManifest.from_json(json.dumps(wrong))
