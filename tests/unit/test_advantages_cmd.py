"""`rollstream advantages` in-process: the reference example, both std options, user errors."""

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli.advantages import app

EXAMPLE = {"rewards": [1, 0, 0.5, 1, 0, 1], "group_ids": [0, 0, 1, 1, 2, 2], "task_ids": [0, 0, 0, 0, 1, 1],
           "loss_masks": [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 0]]}
SIGNS = [1, -1, -1, 1, -1, 1]


def run(tmp_path, data, *args):
    path = tmp_path / "input.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return CliRunner().invoke(app, ["--input", str(path), *args])


def test_reference_example_prints_grpo_task_stats_and_final(tmp_path):
    result = run(tmp_path, EXAMPLE)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"grpo", "task_stats", "final"}
    assert out["grpo"] == pytest.approx([0.707106 * s for s in SIGNS], abs=2e-6)
    assert out["task_stats"]["0"]["tokens"] == 9 and out["task_stats"]["1"]["tokens"] == 5
    assert out["task_stats"]["0"]["mean"] == pytest.approx(-0.078567, abs=1e-6)
    assert out["task_stats"]["0"]["std"] == pytest.approx(0.745354, abs=1e-6)
    assert out["task_stats"]["1"]["mean"] == pytest.approx(-0.141421, abs=1e-6)
    assert out["task_stats"]["1"]["std"] == pytest.approx(0.774596, abs=1e-6)
    assert out["final"] == pytest.approx([1.0541, -0.8433, -0.8433, 1.0541, -0.7303, 1.0954], abs=5e-5)


def test_population_option_reproduces_its_reference(tmp_path):
    result = run(tmp_path, EXAMPLE, "--std", "population")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["grpo"] == pytest.approx([0.999998 * s for s in SIGNS], abs=3e-6)
    assert out["final"] == pytest.approx([1.1180, -0.8944, -0.8944, 1.1180, -0.8165, 1.2247], abs=5e-5)


def test_task_scale_multiplies_the_named_tasks_final_advantages_only(tmp_path):
    plain = json.loads(run(tmp_path, EXAMPLE).stdout)
    result = run(tmp_path, EXAMPLE, "--task-scale", "1=0.5")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    tasks = EXAMPLE["task_ids"]
    assert out["final"] == pytest.approx([f * (0.5 if t == 1 else 1.0) for f, t in zip(plain["final"], tasks)])
    assert out["grpo"] == plain["grpo"]


def test_positive_only_keeps_no_negative_final_advantage(tmp_path):
    out = json.loads(run(tmp_path, EXAMPLE, "--positive-only").stdout)
    plain = json.loads(run(tmp_path, EXAMPLE).stdout)
    assert out["final"] == pytest.approx([max(f, 0.0) for f in plain["final"]])


@pytest.mark.parametrize("option, message", [
    ("calc=0.5", "not a task of the input"),
    ("1=0", "positive number"),
    ("1=x", "positive number"),
    ("1", "positive number"),
])
def test_bad_task_scale_is_one_line_and_nonzero_exit(tmp_path, option, message):
    result = run(tmp_path, EXAMPLE, "--task-scale", option)
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""


@pytest.mark.parametrize("data, message", [
    ("{not json", "is not JSON"),
    ([1, 2], "must hold one JSON object"),
    ({**EXAMPLE, "loss_masks": None}, "lacks the list(s) loss_masks"),
    ({**EXAMPLE, "rewards": [1, 0]}, "one entry per trajectory expected"),
    ({**EXAMPLE, "rewards": ["a"] * 6}, "invalid input"),
])
def test_bad_input_is_one_line_and_nonzero_exit(tmp_path, data, message):
    result = run(tmp_path, data)
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""


def test_missing_file_is_a_user_error(tmp_path):
    result = CliRunner().invoke(app, ["--input", str(tmp_path / "absent.json")])
    assert result.exit_code == 2 and "cannot read" in result.stderr


def test_help_shows_an_example():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "rollstream advantages --input" in result.stdout
