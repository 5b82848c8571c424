"""`rollstream learner`'s option checks, before any model, broker or process group is touched."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import learner as learner_cmd


def test_an_unknown_parallelism_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(learner_cmd.app, ["--run", "r", "--model", str(tmp_path), "--parallelism", "zero3"])
    assert result.exit_code == 2
    assert result.output.strip() == ("rollstream learner: invalid setting: parallelism: "
                                     "Input should be 'ddp' or 'fsdp'")


def test_retention_settings_in_the_settings_file_are_validated(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = tmp_path / "learner.json"
    settings.write_text('{"stale_step": 5, "keep_versions": 0}')
    result = CliRunner().invoke(learner_cmd.app, ["--run", "r", "--model", str(tmp_path), "--settings", str(settings)])
    assert result.exit_code == 2
    assert result.output.strip() == "rollstream learner: invalid setting: keep_versions: Input should be greater than 0"
