"""Delta versions (learner/delta.py): encode and apply are exact on raw bytes for every dtype,
a corrupted or misapplied delta is refused, and the learner's stager puts a full snapshot where
the chain must restart. Seeded random cases stand in for property tests (no hypothesis here)."""

from __future__ import annotations

import io
import json

import pytest
import torch
import zstandard
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.delta import apply_change, apply_delta, catch_up_plan, encode_delta
from learner.manifest import ShardIntegrityError, decode_version, tensor_sha256
from learner.publish import VersionStager, served_tensors, tied_aliases, without_aliases
from schemas.weight_layout import MANIFEST_FILE, WeightManifest

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_sha256(a) == tensor_sha256(b)


def _random_version(generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = [(int(torch.randint(1, 40, (1,), generator=generator)), int(torch.randint(1, 40, (1,), generator=generator)))
              for _ in range(4)] + [(7,), (1,), (0,)]
    return {f"t{i}": torch.randn(shape, generator=generator).to(dtype) for i, shape in enumerate(shapes)}


def _step(tensors: dict[str, torch.Tensor], generator: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    """A change like an optimizer step of relative size `scale` (computed in float32, rounded back),
    leaving one tensor untouched."""
    out = {}
    for i, (name, t) in enumerate(tensors.items()):
        if i == 1:
            out[name] = t.clone()
            continue
        moved = t.float() * (1 + scale * torch.randn(t.shape, generator=generator))
        out[name] = moved.to(t.dtype)
    return out


def _delta(previous, new, version=1, chain=(0,), max_shard_bytes=1 << 20):
    return encode_delta(previous, new, version=version, step=version, config={"a": 1}, base_chain=chain,
                        max_shard_bytes=max_shard_bytes, zstd_level=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_applying_a_delta_gives_the_new_version_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(hash(str(dtype)) % 1000)
    for case in range(12):
        previous = _random_version(generator, dtype)
        new = _step(previous, generator, scale=[1e-6, 1e-4, 1e-2, 1.0][case % 4])
        manifest, shards = _delta(previous, new, max_shard_bytes=[64, 1 << 20][case % 2])
        rebuilt, checksums = apply_delta(previous, manifest, shards, workers=[1, 3][case // 2 % 2])
        assert list(rebuilt) == list(new)
        for name in new:
            assert _same_bytes(rebuilt[name], new[name]), (case, name)
            assert checksums[name] == tensor_sha256(new[name])
        assert _same_bytes(rebuilt["t1"], previous["t1"])  # the untouched tensor


def test_special_values_survive_exactly():
    previous = {"w": torch.tensor([0.0, 1.0, float("inf"), 3.0, 4.0])}
    new = {"w": torch.tensor([-0.0, float("nan"), float("-inf"), 3.0, 1e-45])}
    manifest, shards = _delta(previous, new)
    rebuilt, _ = apply_delta(previous, manifest, shards)
    assert _same_bytes(rebuilt["w"], new["w"])  # the sign of zero and the NaN's bits included


def test_an_unchanged_tensor_takes_no_bytes_and_a_version_that_did_not_change_is_tiny():
    previous = {"a": torch.randn(256, 256), "b": torch.randn(256)}
    manifest, shards = _delta(previous, {k: v.clone() for k, v in previous.items()})
    assert sum(len(s) for s in shards.values()) < 200
    rebuilt, _ = apply_delta(previous, manifest, shards)
    assert all(_same_bytes(rebuilt[k], previous[k]) for k in previous)


def test_a_small_bfloat16_step_stages_a_small_fraction_of_the_full_bytes():
    generator = torch.Generator().manual_seed(0)
    previous = {"w": (0.02 * torch.randn(512, 512, generator=generator)).bfloat16()}
    new = {"w": (previous["w"].float() + 1e-6 * torch.randn(512, 512, generator=generator).sign()).bfloat16()}
    _, shards = _delta(previous, new)
    assert sum(len(s) for s in shards.values()) < 0.1 * previous["w"].numel() * 2


def test_tied_weights_are_encoded_once_and_rebuilt_exactly():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         vocab_size=100, tie_word_embeddings=True))
    aliases = tied_aliases(model)
    assert aliases == {"lm_head.weight"}
    previous = without_aliases({k: v.clone() for k, v in model.state_dict().items()}, aliases)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1e-3)  # lm_head moves with it: they are one parameter
    new = without_aliases(model.state_dict(), aliases)
    manifest, shards = _delta(previous, new)
    assert "lm_head.weight" not in {t.name for t in manifest.tensors}
    rebuilt, _ = apply_delta(previous, manifest, shards)
    assert _same_bytes(rebuilt["model.embed_tokens.weight"], model.lm_head.weight.detach())

    # The raw state dict (two names on one storage) encodes and applies as well.
    whole_previous = dict(model.state_dict())
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)
    whole_new = {k: v.clone() for k, v in model.state_dict().items()}
    manifest, shards = _delta(whole_previous, whole_new)
    rebuilt, _ = apply_delta({k: v.clone() for k, v in whole_previous.items()}, manifest, shards)
    assert _same_bytes(rebuilt["lm_head.weight"], whole_new["model.embed_tokens.weight"])


def _flip_last_byte(data: bytes) -> bytes:
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    return bytes(corrupted)


def test_a_corrupted_delta_shard_is_refused_by_its_sha256():
    previous = {"w": torch.randn(64, 64)}
    manifest, shards = _delta(previous, {"w": previous["w"] * 1.001})
    (file,) = shards
    with pytest.raises(ShardIntegrityError, match="sha256 .* does not match"):
        apply_delta(previous, manifest, {file: _flip_last_byte(shards[file])})
    with pytest.raises(ShardIntegrityError, match="missing"):
        apply_delta(previous, manifest, {})


def test_a_delta_whose_result_differs_from_the_manifest_is_refused():
    # A change that verifies as a shard (its sha256 recomputed, as a faulty encoder would write it)
    # but does not give the tensor the manifest names: the per-tensor sha256 of the result refuses it.
    previous = {"w": torch.randn(64, 64)}
    right, right_shards = _delta(previous, {"w": previous["w"] * 1.001})
    other, other_shards = _delta(previous, {"w": previous["w"] * 1.002})
    forged = right.model_copy(update={"shards": other.shards})
    for workers in (1, 2):
        with pytest.raises(ShardIntegrityError, match="tensor w has sha256 .* after applying the delta"):
            apply_delta(previous, forged, other_shards, workers=workers)
    # The right delta on the wrong base is refused the same way.
    with pytest.raises(ShardIntegrityError, match="after applying the delta"):
        apply_delta({"w": previous["w"] + 1}, right, right_shards)
    with pytest.raises(ShardIntegrityError, match="the base has no tensor"):
        apply_delta({"w": previous["w"].double()}, right, right_shards)


def test_versions_with_other_tensors_cannot_be_a_delta():
    with pytest.raises(ValueError, match="stage it full"):
        _delta({"w": torch.zeros(3)}, {"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="stage it full"):
        _delta({"w": torch.zeros(3)}, {"w": torch.zeros(3).bfloat16()})


def test_a_delta_manifest_names_its_base_and_chain_and_round_trips():
    previous = {"w": torch.randn(8)}
    manifest, _ = _delta(previous, {"w": previous["w"] + 1}, version=13, chain=(10, 11, 12))
    assert (manifest.kind, manifest.base_version, manifest.chain, manifest.snapshot_version) == ("delta", 12, (10, 11, 12, 13), 10)
    assert WeightManifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ShardIntegrityError, match="is a delta on version 12"):
        decode_version(manifest, {})
    data = json.loads(manifest.to_json())
    with pytest.raises(ValueError, match="must apply on version 12"):
        WeightManifest.model_validate(data | {"base_version": 11})
    with pytest.raises(ValueError, match="is not snapshot..13"):
        WeightManifest.model_validate(data | {"chain": [10, 12, 13]})


def test_a_manifest_written_before_deltas_still_reads_as_a_full_version():
    old = {"format": "rollstream.weights/1", "version": 4, "step": 4, "config": {}, "shards": [],
           "tensors": [{"name": "w", "shape": [2], "dtype": "float32", "shard": "model-00001-of-00001.safetensors"}]}
    manifest = WeightManifest.from_json(json.dumps(old))
    assert (manifest.kind, manifest.chain, manifest.snapshot_version, manifest.tensors[0].sha256) == ("full", (), 4, None)


def test_a_reader_applies_only_the_deltas_after_the_version_it_holds_else_starts_from_the_snapshot():
    chain = (20, 21, 22, 23)
    assert catch_up_plan(chain, 21) == (None, [22, 23])
    assert catch_up_plan(chain, 20) == (None, [21, 22, 23])
    assert catch_up_plan(chain, None) == (20, [21, 22, 23])
    assert catch_up_plan(chain, 17) == (20, [21, 22, 23])  # too far behind: another chain
    assert catch_up_plan((30,), None) == (30, [])


class _Store:
    """What VersionStager needs of a Minio client: put_object into a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, bucket, key, data: io.BytesIO, length, content_type=None):
        self.objects[key] = data.read()


def _kinds(store: _Store, run: str) -> dict[int, tuple[str, tuple[int, ...]]]:
    out = {}
    for key, data in store.objects.items():
        if key.startswith(run) and key.endswith(MANIFEST_FILE):
            m = WeightManifest.from_json(data)
            out[m.version] = (m.kind, m.chain)
    return out


def test_the_stager_snapshots_every_interval_and_after_a_restart_and_deltas_in_between():
    store, weights = _Store(), {"w": torch.randn(32, 32)}
    stager = VersionStager(store, "r", snapshot_interval=4, max_shard_bytes=1 << 20, zstd_level=3)
    for version in range(0, 7):
        weights = {"w": weights["w"] * 1.0001}
        stager.stage(weights, version=version, step=version, config={})
    restarted = VersionStager(store, "r", snapshot_interval=4, max_shard_bytes=1 << 20, zstd_level=3)
    restarted.stage({"w": weights["w"] * 2}, version=7, step=7, config={})
    restarted.stage({"w": torch.randn(33, 32)}, version=9, step=9, config={})  # a gap: full again
    restarted.stage({"w": torch.randn(33, 32).double()}, version=10, step=10, config={})  # other dtype
    kinds = _kinds(store, "r")
    assert kinds == {0: ("full", ()), 1: ("delta", (0, 1)), 2: ("delta", (0, 1, 2)), 3: ("delta", (0, 1, 2, 3)),
                     4: ("full", ()), 5: ("delta", (4, 5)), 6: ("delta", (4, 5, 6)), 7: ("full", ()),
                     9: ("full", ()), 10: ("full", ())}
    assert stager.chains[6] == (4, 5, 6) and restarted.chains[7] == (7,)


def test_weights_are_converted_once_to_the_served_dtype_and_integers_are_left_alone():
    tensors = {"w": torch.randn(4), "ids": torch.arange(3)}
    served = served_tensors(tensors, "bfloat16")
    assert (served["w"].dtype, served["ids"].dtype) == (torch.bfloat16, torch.int64)
    assert served_tensors(tensors, None)["w"] is tensors["w"]


@pytest.mark.parametrize("length", [15, 17])
def test_a_change_that_is_not_the_tensors_size_is_refused(length):
    base = torch.zeros(4, dtype=torch.float32)  # 16 bytes
    change = zstandard.ZstdCompressor().compress(bytes(length))
    with pytest.raises(ShardIntegrityError, match="bytes for a tensor of 16"):
        apply_change(base, change, zstandard.ZstdDecompressor())
    with pytest.raises(ShardIntegrityError, match="undecodable change"):
        apply_change(base, b"not zstd", zstandard.ZstdDecompressor())
