"""The default policy checkpoint: what `rollstream model init` writes and how transformers loads it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from pipeline.model_cmd import app
from pipeline.model_init import IM_END, PolicyModelSettings, init_model


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


def test_every_byte_is_its_own_token_and_control_tokens_are_single_tokens(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = "ls -la /tmp && echo 'héllo'\n"
    assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode())
    for tag in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>"]:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    assert tokenizer.eos_token == IM_END


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
