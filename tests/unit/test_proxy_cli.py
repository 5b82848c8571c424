"""`rollstream proxy`'s refusals, in-process with the runner: each is one line and exit 2, before any
tokenizer, broker or engine is touched."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cli.toolkit import BAD_INPUT


def _one_line(result, needle: str) -> None:
    assert result.exit_code == BAD_INPUT, (result.output, result.exception)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("rollstream proxy: ") and needle in line, line


def test_proxy_refuses_a_model_without_a_tokenizer_in_one_line(tmp_path):
    _one_line(CliRunner().invoke(app, ["proxy", "--run", "r1", "--model", str(tmp_path)]), "with a tokenizer")


def test_proxy_refuses_an_unknown_reencode_rule_in_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    result = CliRunner().invoke(app, ["proxy", "--run", "r1", "--model", str(tmp_path), "--reencode-mismatch", "keep"])
    _one_line(result, "reencode_mismatch")


def test_proxy_refuses_a_malformed_engine_in_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    result = CliRunner().invoke(app, ["proxy", "--run", "r1", "--model", str(tmp_path), "--engine", "http://h:1"])
    _one_line(result, "--engine must be current=URL")
