"""`rollstream model sft` end to end on a tiny model: oracle demonstrations of calc, a few dozen
optimizer steps whose loss falls, checkpoints along the way and at the end; then `rollstream model
eval` on one of them: a real vLLM engine (launch_engine) serves it, and real agent-loop rollouts
against it, on the split --eval-split names, run to an end (no task_error: nothing crashed). sft's
own evaluation is the same `evaluate` call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from pipeline.cli.model import app
from pipeline.policy.model_init import PolicyModelSettings, init_model

pytestmark = pytest.mark.integration

TINY = PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256)


def test_sft_lowers_the_loss_and_its_checkpoints_serve_real_rollouts(infra, tmp_path: Path):
    source, out = tmp_path / "policy", tmp_path / "policy-sft"
    init_model(TINY, source)
    result = CliRunner().invoke(app, ["sft", "--model", str(source), "--out", str(out), "--families", "calc",
                                      "--samples", "24", "--epochs", "2", "--batch-size", "2", "--lr", "3e-3",
                                      "--checkpoint-every", "10", "--eval-episodes", "0", "--json"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["demonstrations"] == 24 and report["steps"] == 24
    assert report["families"]["calc"]["split"] == "train"  # the default demonstration split
    assert report["last_loss"] < 0.7 * report["first_loss"], (report["first_loss"], report["last_loss"])

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(source).chat_template
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == TINY.hidden_size

    # steps 10 and 20 of 24; the last step's checkpoint is `out` itself
    assert [(c["step"], c["path"]) for c in report["checkpoints"]] == [
        (10, str(out / "steps" / "000010")), (20, str(out / "steps" / "000020"))]
    early = AutoModelForCausalLM.from_pretrained(out / "steps" / "000010")
    final = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(early.lm_head.weight, final.lm_head.weight)
    assert "eval" not in report

    result = CliRunner().invoke(app, ["eval", "--model", str(out / "steps" / "000020"), "--families", "calc",
                                      "--eval-episodes", "3", "--eval-split", "calc=rl", "--json"])
    assert result.exit_code == 0, result.output[-3000:]
    evaluation = json.loads(result.stdout.strip().splitlines()[-1])["eval"]
    assert evaluation["temperature"] == 0.8
    assert evaluation["split"] == {"calc": "rl"}  # --eval-split, not the default held-out split
    (row,) = evaluation["table"]
    assert row["family"] == "calc" and row["episodes"] == 3
    assert "task_error" not in row["statuses"], row
    assert abs(sum(row["statuses"].values()) - 1.0) < 1e-9
