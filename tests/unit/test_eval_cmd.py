"""`rollstream eval`'s choices before anything starts: which samples, and refusals in one line."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline import cli
from pipeline.run.eval import validation_sources
from pipeline.policy.sft import EVAL_SPLITS


def test_std_means_each_familys_held_out_split_and_samples_cap_the_count():
    sources = validation_sources(["calc", "os"], "std", 5)
    assert [(s.task, s.split, s.count) for s in sources] == [("calc", EVAL_SPLITS["calc"], 5),
                                                             ("os", EVAL_SPLITS["os"], 5)]


def test_a_split_a_family_lacks_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(cli.app, ["eval", "--checkpoint", str(tmp_path), "--families", "calc",
                                          "--split", "nope"])
    assert result.exit_code == 2
    assert "family 'calc' has no split 'nope'" in result.output


def test_a_version_without_its_run_is_refused(tmp_path):
    result = CliRunner().invoke(cli.app, ["eval", "--checkpoint", "12", "--families", "calc"])
    assert result.exit_code == 2
    assert "needs --run" in result.output


def test_a_checkpoint_that_is_neither_a_directory_nor_a_version_is_refused(tmp_path):
    result = CliRunner().invoke(cli.app, ["eval", "--checkpoint", str(tmp_path / "missing"), "--families", "calc"])
    assert result.exit_code == 2
    assert "neither a checkpoint directory" in result.output
