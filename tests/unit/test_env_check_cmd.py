"""`rollstream env check`, run in-process against the module's own app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from env_workers.envs import registry
from env_workers.envs.base import DEFAULT_DATA_ROOT, EnvSettings
from pipeline.cli import env as env_cmd

DB_DEV = DEFAULT_DATA_ROOT / "agentbench" / "dbbench" / "dev.jsonl"
KG_DEV = DEFAULT_DATA_ROOT / "metaqa" / "2-hop" / "qa_dev.txt"

runner = CliRunner()


def test_json_output_is_one_object_with_exactly_the_check_keys() -> None:
    result = runner.invoke(env_cmd.app, ["check", "--family", "db", "--data", str(DB_DEV), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"family": "db", "tasks": 60, "golden_pass": 60, "noop_pass": 0,
                                         "errors": 0, "failing_ids": []}


def test_limit_checks_only_the_first_tasks_of_a_kg_question_file() -> None:
    result = runner.invoke(env_cmd.app, ["check", "--family", "kg", "--data", str(KG_DEV), "--limit", "5", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["tasks"] == 5


def test_default_output_is_a_table_with_unfit_ids() -> None:
    result = runner.invoke(env_cmd.app, ["check", "--family", "calc", "--split", "dev", "--limit", "3"])
    assert result.exit_code == 0
    assert "golden_pass" in result.stdout and "unfit for training (0): none" in result.stdout


def test_failing_task_ids_are_listed(tmp_path: Path) -> None:
    broken = tmp_path / "calc.jsonl"
    broken.write_text(json.dumps({"id": "zero", "start": 0, "steps": [], "answer": 0}) + "\n", encoding="utf-8")
    result = runner.invoke(env_cmd.app, ["check", "--family", "calc", "--data", str(broken), "--json"])
    assert json.loads(result.stdout)["failing_ids"] == ["zero"]  # the no-op (submit 0) passes it


def test_data_root_comes_from_rollstream_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "agentbench" / "dbbench"
    target.mkdir(parents=True)
    lines = DB_DEV.read_text(encoding="utf-8").splitlines()[:2]
    (target / "dev.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setenv("ROLLSTREAM_DATA", str(tmp_path))
    result = runner.invoke(env_cmd.app, ["check", "--family", "db", "--split", "dev", "--json"])
    assert json.loads(result.stdout)["tasks"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--family", "chess", "--split", "dev"], "unknown family 'chess'"),
        (["--family", "db"], "give exactly one of --data PATH or --split NAME"),
        (["--family", "db", "--split", "nope"], "has no split 'nope'"),
        (["--family", "db", "--data", "/no/such/file.jsonl"], "no such data file"),
    ],
)
def test_user_errors_print_one_line_and_exit_nonzero(args: list[str], message: str) -> None:
    result = runner.invoke(env_cmd.app, ["check", *args])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unreadable_data_file_is_a_user_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n", encoding="utf-8")
    result = runner.invoke(env_cmd.app, ["check", "--family", "db", "--data", str(bad)])
    assert result.exit_code == 2 and "cannot read" in result.stderr


def test_help_shows_an_example() -> None:
    result = runner.invoke(env_cmd.app, ["check", "--help"])
    assert "Example: rollstream env check" in result.stdout


def _variant_file(tmp_path: Path) -> Path:
    """Three calc tasks marked as variants of two kinds (any family's sample may carry `variant`), one unfit."""
    tasks = [dict(task) for task in registry.samples("calc", "dev", EnvSettings())[:2]]
    tasks.append({"id": "zero", "start": 0, "steps": [], "answer": 0})  # the no-op (submit 0) passes it
    kinds = ["moved_file", "working_directory", "working_directory"]
    lines = [json.dumps({**task, "id": f"{task['id']}~v", "variant": {"name": "v", "kind": kind}})
             for task, kind in zip(tasks, kinds)]
    path = tmp_path / "variants.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_variants_are_counted_per_kind_and_named_among_the_unfit(tmp_path: Path) -> None:
    result = runner.invoke(env_cmd.app, ["check", "--family", "calc", "--data", str(_variant_file(tmp_path)), "--json"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert (report["tasks"], report["golden_pass"], report["noop_pass"], report["failing_ids"]) == (3, 3, 1, ["zero~v"])
    assert report["variants"] == {
        "moved_file": {"tasks": 1, "golden_pass": 1, "noop_pass": 0, "errors": 0},
        "working_directory": {"tasks": 2, "golden_pass": 2, "noop_pass": 1, "errors": 0},
    }


def test_the_table_has_a_row_per_variant_kind_and_a_total(tmp_path: Path) -> None:
    result = runner.invoke(env_cmd.app, ["check", "--family", "calc", "--data", str(_variant_file(tmp_path))])
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["moved_file", "working_directory", "all"]
    assert "unfit for training (1): zero~v" in result.stdout
