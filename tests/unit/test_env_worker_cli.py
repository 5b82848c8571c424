"""`rollstream env-worker` rejects bad arguments with one line and a non-zero exit."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from pipeline.cli.env_worker import env_worker, parse_engines

app = typer.Typer()
app.command()(env_worker)


def test_engines_are_grouped_by_pool():
    assert parse_engines(["current=http://a:1", "stale=http://b:2", "current=http://c:3"]) == {
        "current": ["http://a:1", "http://c:3"], "stale": ["http://b:2"]}


def test_model_directory_without_a_tokenizer_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["--run", "r", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a checkpoint directory" in result.output


def test_engine_spec_without_a_pool_is_a_one_line_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    result = CliRunner().invoke(app, ["--run", "r", "--model", str(tmp_path), "--engine", "http://a:1"])
    assert result.exit_code == 2
    assert "--engine must be current=URL or stale=URL" in result.output
