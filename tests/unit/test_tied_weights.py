"""A tied tensor (lm_head.weight sharing the embedding) is published once, under its first name."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.manifest import encode_version, specs_of
from learner.publish import tied_aliases, without_aliases
from schemas.weight_layout import plan_buckets


def tiny_model(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=50, max_position_embeddings=32,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


def test_the_tied_lm_head_is_an_alias_of_the_embedding():
    assert tied_aliases(tiny_model(tied=True)) == frozenset({"lm_head.weight"})


def test_an_untied_model_has_no_aliases():
    assert tied_aliases(tiny_model(tied=False)) == frozenset()


def test_manifest_shards_and_buckets_hold_the_tied_tensor_once():
    model = tiny_model(tied=True)
    tensors = without_aliases(model.state_dict(), tied_aliases(model))
    assert list(tensors) == [name for name in model.state_dict() if name != "lm_head.weight"]
    manifest, _ = encode_version(tensors, version=1, step=1, config={}, max_shard_bytes=1 << 20)
    names = [t.name for t in manifest.tensors]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    buckets = plan_buckets(specs_of(tensors), 1 << 12)
    bucketed = [slot.spec.name for bucket in buckets for slot in bucket.slots]
    assert sorted(bucketed) == sorted(tensors)


def test_reloading_the_published_tensors_restores_lm_head_through_the_tie():
    source, target = tiny_model(tied=True), tiny_model(tied=True)
    with torch.no_grad():
        source.model.embed_tokens.weight.mul_(3.0)
    target.load_state_dict(without_aliases(source.state_dict(), tied_aliases(source)), strict=False)
    assert torch.equal(target.lm_head.weight, source.lm_head.weight)
