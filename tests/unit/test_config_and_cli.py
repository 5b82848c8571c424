"""Configuration sources and the CLI's behaviour for commands that do not exist yet."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.run.config import load_config


def test_environment_overrides_the_yaml_file_which_overrides_defaults(tmp_path, monkeypatch):
    for var in ("KAFKA_HOST", "KAFKA_PORT", "MINIO_HOST", "MINIO_PORT", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("run: from-file\nkafka:\n  bootstrap_servers: file:1\nobject_store:\n  endpoint: file:2\n  access_key: file-user\n")
    monkeypatch.setenv("ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS", "env:9")
    cfg = load_config(cfg_file)
    assert cfg.run == "from-file"
    assert cfg.kafka.bootstrap_servers == "env:9"
    assert cfg.object_store.endpoint == "file:2"


def test_a_copy_with_a_section_replaced_keeps_that_sections_file_values_under_an_environment_override(tmp_path,
                                                                                                       monkeypatch):
    # `replaced` validates again, and the environment wins field by field; a section handed in as a model was
    # once replaced whole by its variables, every other field of it back at the default (bench peer's run
    # lost the file's mix.val_interval under ROLLSTREAM_MIX__MAX_IN_FLIGHT_GROUPS and was refused)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("max_steps: 12\nmix:\n  val_interval: 12\n  weights: {calc: 8}\n")
    monkeypatch.setenv("ROLLSTREAM_MIX__MAX_IN_FLIGHT_GROUPS", "18")
    cfg = load_config(cfg_file)
    copy = cfg.replaced(mix=cfg.mix.model_copy(update={"weights": {}}), max_steps=24)
    assert (copy.mix.val_interval, copy.mix.max_in_flight_groups, copy.mix.weights) == (12, 18, {})
    assert copy.max_steps == 24


def test_infrastructure_variables_reach_the_clients(monkeypatch):
    monkeypatch.setenv("KAFKA_PORT", "19092")
    monkeypatch.setenv("MINIO_ROOT_USER", "alice")
    monkeypatch.setenv("MINIO_ROOT_PASSWORD", "s3cret-pass")
    cfg = load_config()
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert cfg.object_store.access_key == "alice"
    assert cfg.object_store.secret_key.get_secret_value() == "s3cret-pass"
    assert "s3cret-pass" not in repr(cfg)  # secrets are masked when printed


def test_mariadb_variables_reach_the_db_family(monkeypatch):
    monkeypatch.setenv("MARIADB_PORT", "13307")
    monkeypatch.setenv("MARIADB_PASSWORD", "db-pass")
    monkeypatch.setenv("ROLLSTREAM_DATA", "/data/elsewhere")
    envs = load_config().envs
    assert (envs.db_mysql_port, envs.db_mysql_password.get_secret_value()) == (13307, "db-pass")
    assert str(envs.data_root) == "/data/elsewhere"


def test_model_sft_refuses_a_config_whose_environments_do_not_validate(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text("envs:\n  calc_operands: [9, 2]\n")
    result = CliRunner().invoke(app, ["model", "sft", "--model", str(model), "--out", str(tmp_path / "out"),
                                      "--config", str(config)])
    assert result.exit_code == 2
    assert "calc_operands" in result.output and "smallest <= largest" in result.output


def test_kafka_settings_become_each_clients_own_names():
    cfg = load_config()
    assert cfg.kafka.as_confluent()["bootstrap.servers"] == cfg.kafka.bootstrap_servers
    assert cfg.kafka.as_kafka_python()["bootstrap_servers"] == cfg.kafka.bootstrap_servers.split(",")
    assert cfg.kafka.faust_broker.startswith("kafka://")


@pytest.mark.parametrize("weights, message", [("kg=2", "weights name families that are not trained: kg"),
                                               ("calc=0", "FAMILY=N"), ("3", "FAMILY=N")])
def test_dispatch_refuses_weights_in_one_line_before_touching_the_broker(weights, message):
    result = CliRunner().invoke(app, ["dispatch", "--run", "r", "--families", "calc,os", "--max-groups", "1",
                                      "--weights", weights])
    assert result.exit_code == 2 and message in result.output
