"""The default policy checkpoint: what `rollstream model init` writes and how transformers loads it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from pipeline.cli.model import app
from pipeline.policy.model_init import IM_END, PolicyModelSettings, build_tokenizer, init_model
from pipeline.policy.tokenizer_corpus import default_corpus


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy")
    result = CliRunner().invoke(app, ["init", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_init_writes_a_hugging_face_checkpoint(checkpoint):
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert "<tool_call>" in json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]


def test_checkpoint_loads_with_auto_classes_as_a_float32_qwen2_with_head_dim_64(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = model.config
    assert config.model_type == "qwen2" and model.dtype == torch.float32
    assert config.hidden_size // config.num_attention_heads == 64
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)


def test_auto_tokenizer_gets_back_exactly_the_saved_tokenizer(checkpoint):
    loaded = json.loads(AutoTokenizer.from_pretrained(checkpoint).backend_tokenizer.to_str())
    assert loaded == json.loads((checkpoint / "tokenizer.json").read_text())


def test_any_text_survives_encode_and_decode_and_control_tokens_are_single_tokens(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for text in ["ls -la /tmp && echo 'héllo'\n", "SELECT `名前` FROM t; -- ☃ \t\x00\x7f", "((17 + 5) * 3) - 8"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for tag in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>"]:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    assert tokenizer.eos_token == IM_END


def test_default_tokenizer_writes_the_environments_episodes_at_least_three_times_shorter_than_bytes(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = default_corpus()
    tokens = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts)
    assert sum(len(text.encode()) for text in texts) / tokens >= 3.0
    assert len(tokenizer) == PolicyModelSettings().vocab_size + 7


def test_bytes_only_vocabulary_makes_every_byte_its_own_token(tmp_path):
    result = CliRunner().invoke(app, ["init", "--out", str(tmp_path / "b"), "--layers", "1", "--vocab-size", "256"])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "b")
    text = "ls -la /tmp && echo 'héllo'\n"
    assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode())
    assert len(tokenizer) == 256 + 7


def test_learned_merges_are_the_same_for_the_same_corpus():
    corpus = ["<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 17}}</tool_call>", "SELECT name FROM users"] * 20
    first, second = build_tokenizer(corpus, 300), build_tokenizer(corpus, 300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first.encode("SELECT name FROM users", add_special_tokens=False)) < len("SELECT name FROM users")


def test_a_vocabulary_beyond_bytes_needs_a_corpus_and_one_below_bytes_is_refused():
    with pytest.raises(ValueError, match="corpus"):
        build_tokenizer((), 1024)
    with pytest.raises(ValueError, match="256"):
        PolicyModelSettings(vocab_size=100)


def test_forward_pass_gives_a_distribution_over_the_vocabulary(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[257, 104, 105]])).logits  # (B=1, T=3, V)
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_gives_identical_weights_and_another_seed_does_not(tmp_path, checkpoint):
    again = init_model(PolicyModelSettings(), tmp_path / "again")
    other = init_model(PolicyModelSettings(seed=1), tmp_path / "other")
    assert _sha(Path(again["out"]) / "model.safetensors") == _sha(checkpoint / "model.safetensors")
    assert _sha(Path(other["out"]) / "model.safetensors") != _sha(checkpoint / "model.safetensors")


def test_head_dim_other_than_64_is_a_one_line_user_error(tmp_path):
    result = CliRunner().invoke(app, ["init", "--out", str(tmp_path / "m"), "--hidden", "192", "--heads", "4"])
    assert result.exit_code == 2
    assert "head" in result.output.lower() or "64" in result.output
    assert not (tmp_path / "m").exists()


def test_init_refuses_a_directory_that_is_not_empty(checkpoint):
    result = CliRunner().invoke(app, ["init", "--out", str(checkpoint)])
    assert result.exit_code == 2 and "not an empty directory" in result.output


def test_json_output_is_one_object_with_the_parameter_count(tmp_path):
    result = CliRunner().invoke(app, ["init", "--out", str(tmp_path / "p"), "--layers", "1", "--json"])
    summary = json.loads(result.stdout)
    assert summary["num_layers"] == 1 and summary["head_dim"] == 64 and summary["parameters"] > 0
