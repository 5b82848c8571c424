"""Every `rollstream` command fails the same way: one line on stderr, `rollstream <command>: what is
wrong`, exit 2 for a bad configuration, input file or unreachable service, and never a traceback.

The commands are found by walking the real command tree, so a command added later is covered
without a change here. No service is needed: the broker named in the last test is one that is not
there.
"""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from confluent_kafka import KafkaError, KafkaException
from typer.core import TyperCommand
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cli.toolkit import BAD_INPUT, App, Command
from pipeline.run.config import REPO_ROOT
from schemas import topics

ROOT = typer.main.get_command(app)
# `replay TOPIC` runs the hidden `topic` command under the topic's name.
REPLAY_TOPIC = ("replay", "topic")


def _commands(command=ROOT, path: tuple[str, ...] = ()):
    children = getattr(command, "commands", None)
    if children is None:
        yield path, command
        return
    for name, child in children.items():
        yield from _commands(child, (*path, name))


COMMANDS = dict(_commands())
WITH_CONFIG = sorted(path for path, command in COMMANDS.items()
                     if any("--config" in param.opts for param in command.params))


def _harmless(param, tmp_path: Path) -> list[str]:
    """A value of the option's type that passes parsing and starts nothing."""
    kind = param.type_descriptor.annotation
    name = [] if param.param_type_name == "argument" else [param.opts[0]]  # an argument is its value alone
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [*name, next(iter(kind)).value]
    if kind in (int, float):
        return [param.opts[0], "1"]
    if param.opts[0] == "--out":
        return [param.opts[0], str(tmp_path / "out.jsonl")]
    if kind is Path:
        return [param.opts[0], str(tmp_path / "absent")]
    return [param.opts[0], "x"]


def _args(path: tuple[str, ...], tmp_path: Path, *extra: str) -> list[str]:
    command = COMMANDS[path]
    words = [*path[:-1], topics.TRAJECTORIES] if path == REPLAY_TOPIC else list(path)
    for param in command.params:
        if param.required and "--config" not in param.opts:
            words += _harmless(param, tmp_path)
    return [*words, *extra]


def _assert_one_line_failure(result, code: int, name: str, *needles: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"rollstream {name}: "), lines[0]
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_every_command_reports_failures_through_the_toolkit():
    plain = [" ".join(path) for path, command in COMMANDS.items() if not isinstance(command, Command)]
    assert plain == [] and all(isinstance(c, TyperCommand) for c in COMMANDS.values())


def test_the_walk_finds_the_commands_that_take_a_configuration():
    assert {("up",), ("infra", "status"), ("bench", "bus"), ("streams", "worker"), REPLAY_TOPIC} <= set(WITH_CONFIG)


@pytest.mark.parametrize("path", WITH_CONFIG, ids=" ".join)
def test_a_missing_configuration_file_is_one_line_and_exit_2(path, tmp_path):
    result = CliRunner().invoke(app, _args(path, tmp_path, "--config", "/nonexistent.yaml"))
    name = " ".join([*path[:-1], topics.TRAJECTORIES] if path == REPLAY_TOPIC else path)
    _assert_one_line_failure(result, BAD_INPUT, name, "/nonexistent.yaml", "no such file")


@pytest.mark.parametrize("path", WITH_CONFIG, ids=" ".join)
def test_a_configuration_field_of_the_wrong_type_is_named_in_one_line(path, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("engines:\n  current: many\n")
    result = CliRunner().invoke(app, _args(path, tmp_path, "--config", str(config)))
    name = " ".join([*path[:-1], topics.TRAJECTORIES] if path == REPLAY_TOPIC else path)
    _assert_one_line_failure(result, BAD_INPUT, name, str(config), "engines.current")


@pytest.mark.parametrize("text, needle", [("a: [1\n", "not valid YAML at line 2"),
                                          ("- 1\n", "must be a YAML mapping"),
                                          ("max_stepz: 3\n", "max_stepz: Extra inputs are not permitted")])
def test_a_configuration_that_is_no_mapping_or_names_an_unknown_field_is_one_line(text, needle, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    result = CliRunner().invoke(app, ["infra", "status", "--config", str(config)])
    _assert_one_line_failure(result, BAD_INPUT, "infra status", needle)


def test_a_bad_environment_variable_is_caught_like_a_bad_file(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLSTREAM_MAX_STEPS", "lots")
    result = CliRunner().invoke(app, ["report", "--run", "r"])
    _assert_one_line_failure(result, BAD_INPUT, "report", "max_steps")


@pytest.mark.parametrize("args, needle", [
    (["advantages", "--input", "/no/such/input.json"], "cannot read /no/such/input.json"),
    (["env", "check", "--family", "calc", "--data", "/no/such/data.jsonl"], "no such data file"),
    (["streams", "worker", "--settings", "/no/such/settings.json"], "--settings /no/such/settings.json"),
    (["learner", "--run", "r", "--model", "/no/such/model"], "not a Hugging Face checkpoint directory"),
])
def test_a_missing_input_file_is_one_line_and_exit_2(args, needle):
    result = CliRunner().invoke(app, args)
    name = " ".join(word for word in args[:2] if not word.startswith("-"))
    _assert_one_line_failure(result, BAD_INPUT, name, needle)


def test_an_unreachable_broker_is_one_line_and_nonzero(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("ROLLSTREAM_CONNECT_TIMEOUT_S", "1")
    result = CliRunner().invoke(app, ["infra", "status"])
    _assert_one_line_failure(result, BAD_INPUT, "infra status", "Kafka at 127.0.0.1:1 did not answer within 1 s")


def test_a_kafka_error_a_command_raises_is_one_line_and_exit_2():
    probe = App(name="probe")
    probe.callback()(lambda: None)

    @probe.command("poll")
    def poll() -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))

    result = CliRunner().invoke(probe, ["poll"])
    _assert_one_line_failure(result, BAD_INPUT, "probe poll", "Kafka: Broker transport failure")


def test_the_installed_entry_point_runs_as_a_module_and_fails_in_one_line():
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "infra", "status", "--config", "/nonexistent.yaml"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == BAD_INPUT
    assert done.stderr.strip().splitlines() == ["rollstream infra status: configuration /nonexistent.yaml: no such file"]
