"""`rollstream up`'s plan: every process's command line is one the real command accepts, and the
configuration refuses settings that two components would disagree on."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from pydantic import ValidationError

from env_workers.envs.base import EnvSettings
from env_workers.worker_settings import EnvWorkerSettings
from learner.settings import LearnerSettings
from pipeline import cli
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config, write_config, write_private
from pipeline.dispatch.sources import parse_limit, parse_sources
from pipeline.run.plan import (Child, dispatcher_child, engine_args, env_worker_children, final_validation_round,
                              learner_child, rollstream, command, streams_child, with_metrics_port,
                              with_run_config)
from streams.settings import StreamsSettings

URLS = {"current": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], "stale": ["http://127.0.0.1:8003"]}


def _parse(child: Child) -> dict:
    """Parses the child's arguments with the real command of the module it runs (pipeline.cli.<module>, or
    the whole rollstream command tree for pipeline.cli); returns the leaf's params."""
    assert child.argv[1] == "-m" and child.argv[2].startswith("pipeline.cli")
    app = cli.app if child.argv[2] == "pipeline.cli" else importlib.import_module(child.argv[2]).app
    command = typer.main.get_command(app)
    args = list(child.argv[3:])
    ctx = command.context_class(command, info_name="rollstream")
    while hasattr(command, "get_command"):  # a group (typer carries its own click: no isinstance check)
        name, args = args[0], args[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"no subcommand {name!r}"
        ctx = command.context_class(command, info_name=name, parent=ctx)
    return command.make_context(ctx.info_name, args, parent=ctx.parent).params


@pytest.fixture
def cfg() -> RollstreamConfig:
    return load_config(REPO_ROOT / "configs" / "cpu.yaml")


def test_every_child_command_line_is_accepted_by_its_command(cfg, tmp_path):
    children = [streams_child(cfg, "r1", tmp_path, 6070),
                *env_worker_children(cfg, "r1", tmp_path, tmp_path / "model", URLS, EnvSettings()),
                learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555),
                dispatcher_child(cfg, "r1", tmp_path)]
    assert [c.name for c in children][:2] == ["streams", "env-worker-0"]
    for child in children:
        _parse(child)


def test_every_child_serves_metrics_on_the_port_it_is_given_also_once_restarted(cfg, tmp_path):
    children = [streams_child(cfg, "r1", tmp_path, 6070),
                *env_worker_children(cfg, "r1", tmp_path, tmp_path / "model", URLS, EnvSettings()),
                learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555),
                dispatcher_child(cfg, "r1", tmp_path)]
    for port, child in enumerate(children, start=9100):
        served = with_metrics_port(child, port)
        assert served.metrics_url == f"http://127.0.0.1:{port}/metrics"
        assert _parse(served)["metrics_port"] == port
        assert _parse(served.restarted())["metrics_port"] == port and served.restarted().metrics_port == port
    assert _parse(with_metrics_port(children[-2], 9200).restarted())["resume"]  # the learner still resumes


def test_the_learner_alone_starts_with_openmp_threads_that_sleep_when_they_wait(cfg, tmp_path):
    learner = learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555)
    assert learner.env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert learner.restarted().env == learner.env
    assert streams_child(cfg, "r1", tmp_path, 6070).env == {} and dispatcher_child(cfg, "r1", tmp_path).env == {}


def test_an_engine_supervisor_takes_its_metrics_port_on_the_command_line():
    # pipeline/engine/launch.py passes --metrics-port to `rollstream engine`
    engine = Child("engine", command("engine", "--pool", "current", "--model", "m", "--metrics-port", "9300"))
    assert _parse(engine)["metrics_port"] == 9300
    assert _parse(Child("up", rollstream("up", "--run", "r1")))["run"] == "r1"


def test_a_childs_process_imports_only_what_its_command_needs(cfg, tmp_path):
    # The whole command line imports torch, transformers and vLLM: seconds of CPU per process, taken from
    # the engines that start beside a run's children.
    children = [streams_child(cfg, "r1", tmp_path, 6070), dispatcher_child(cfg, "r1", tmp_path)]
    for child in children:
        module = child.argv[2]
        probe = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules);"
                 " print(','.join(heavy))")
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        assert done.stdout.strip() == "", (module, done.stdout)


def test_settings_files_carry_each_components_whole_settings(cfg, tmp_path):
    streams = streams_child(cfg, "r1", tmp_path, 6070)
    assert StreamsSettings.model_validate_json(next(iter(streams.files.values()))) == cfg.streams
    worker = env_worker_children(cfg, "r1", tmp_path, tmp_path / "model", URLS, EnvSettings())[0]
    settings = EnvWorkerSettings.model_validate_json(next(iter(worker.files.values())))
    assert settings.agent_loop == cfg.agent_loop and settings.engine_urls == URLS
    learner = learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555)
    settings = LearnerSettings(**json.loads(next(iter(learner.files.values()))))
    # the learner's stale_step (retention, stale broadcasts) is the streams' one
    assert settings == cfg.learner.model_copy(update={"stale_step": cfg.streams.stale_step})


def test_learner_broadcasts_to_both_pools_and_stops_at_max_steps(cfg, tmp_path):
    params = _parse(learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555))
    assert params["broadcast_current"] == "http://127.0.0.1:8001,http://127.0.0.1:8002"
    assert params["broadcast_stale"] == "http://127.0.0.1:8003"
    assert params["max_steps"] == cfg.max_steps


def test_the_learner_starts_at_the_configured_niceness_and_is_left_alone_by_default(cfg, tmp_path):
    assert learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555).nice == 0
    niced = cfg.model_copy(update={"learner_nice": 15})
    assert learner_child(niced, "r1", tmp_path, tmp_path / "model", URLS, 29555).nice == 15


def test_dispatcher_gets_the_mix_and_the_group_and_batch_sizes_of_the_streams(cfg, tmp_path):
    params = _parse(dispatcher_child(cfg, "r1", tmp_path))
    assert params["families"] == ",".join(cfg.mix.families)
    assert params["group_size"] == cfg.streams.group_size and params["batch_size"] == cfg.streams.batch_size
    assert parse_limit(params["val_samples"]) == cfg.mix.val_samples
    weighted = cfg.model_copy(update={"mix": cfg.mix.model_copy(update={"weights": {"calc": 3, "db": 2}})})
    assert parse_limit(_parse(dispatcher_child(weighted, "r1", tmp_path))["weights"]) == {"calc": 3, "db": 2}


def test_validation_sample_counts_are_one_number_or_per_family():
    assert parse_limit("6") == 6 and parse_limit("") is None
    assert parse_limit("calc=32,os=6") == {"calc": 32, "os": 6}
    with pytest.raises(ValueError, match="FAMILY=N"):
        parse_limit("calc:32")


def test_engines_get_the_stale_step_sequence_limit_and_a_dtype_only_when_one_is_set(cfg):
    assert engine_args(cfg) == ("--stale-step", str(cfg.streams.stale_step),
                                "--max-model-len", str(cfg.engines.max_model_len))
    chosen = cfg.model_copy(update={"engines": cfg.engines.model_copy(update={"dtype": "bfloat16"})})
    assert engine_args(chosen)[-2:] == ("--dtype", "bfloat16")


def test_engines_get_a_poll_sleep_only_when_the_configuration_sets_one(cfg):
    assert "--poll-sleep-s" not in engine_args(cfg)  # each engine then picks its default for its device
    spinning = cfg.model_copy(update={"engines": cfg.engines.model_copy(update={"poll_sleep_s": 0.0})})
    assert engine_args(spinning)[-2:] == ("--poll-sleep-s", "0.0")


def test_the_run_ends_with_the_validation_round_of_its_last_step(cfg):
    assert final_validation_round(cfg) == cfg.max_steps // cfg.mix.val_interval


def test_max_turns_of_router_and_agent_loop_must_agree():
    with pytest.raises(ValidationError, match="max_turns"):
        RollstreamConfig(streams={"max_turns": 5})


def test_sampling_temperature_of_learner_and_agent_loop_must_agree():
    with pytest.raises(ValidationError, match="temperature"):
        RollstreamConfig(learner={"temperature": 1.0})


def test_a_learner_stale_step_other_than_the_streams_is_refused():
    with pytest.raises(ValidationError, match="stale_step"):
        RollstreamConfig(streams={"stale_step": 5}, learner={"stale_step": 4})
    assert RollstreamConfig(streams={"stale_step": 5}, learner={"stale_step": 5}).learner_settings().stale_step == 5


def test_a_copy_with_changes_keeps_a_stale_step_set_only_under_streams():
    cfg = RollstreamConfig(streams={"stale_step": 2}, max_steps=25)
    copy = cfg.replaced(max_steps=50)
    assert copy.max_steps == 50 and copy.learner_settings().stale_step == 2
    assert RollstreamConfig(**cfg.as_data()) == cfg


def test_a_written_config_reads_back_the_same_with_its_secrets_and_only_its_owner_may_read_it(tmp_path, monkeypatch):
    # load_config lays the infrastructure scripts' variables over the file; the comparison is of the file alone.
    for variable in ("KAFKA_HOST", "KAFKA_PORT", "MINIO_HOST", "MINIO_PORT", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
                     "MARIADB_HOST", "MARIADB_PORT", "MARIADB_USER", "MARIADB_PASSWORD", "ROLLSTREAM_DATA"):
        monkeypatch.delenv(variable, raising=False)
    cfg = RollstreamConfig(envs={"calc_operands": [2, 9], "db_mysql_password": "s3cret", "data_root": str(tmp_path)},
                           streams={"stale_step": 2})
    path = tmp_path / "settings" / "run.json"
    write_config(cfg, path)
    again = load_config(path)
    assert again == cfg and again.envs.db_mysql_password.get_secret_value() == "s3cret"
    assert path.stat().st_mode & 0o077 == 0


def test_env_workers_settings_file_carries_the_db_password_not_its_mask(tmp_path):
    cfg = RollstreamConfig(envs={"db_backend": "mysql", "db_mysql_password": "s3cret"})
    [child] = env_worker_children(cfg.replaced(env_workers={"count": 1}), "r", tmp_path, tmp_path / "model", {}, cfg.envs)
    [text] = child.files.values()
    assert EnvWorkerSettings.model_validate_json(text).env.db_mysql_password.get_secret_value() == "s3cret"


def test_every_learner_setting_is_reachable_from_the_yaml_file(tmp_path):
    retention = {"keep_versions": 5, "keep_stale_versions": 1, "keep_checkpoints": 4, "poll_timeout_s": 0.5,
                 "parallelism": "fsdp", "lr": 2e-6, "checkpoint_interval": 3}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"learner": retention}))  # JSON is YAML
    settings = load_config(path).learner_settings()
    assert {k: getattr(settings, k) for k in retention} == retention


def test_max_steps_must_end_on_a_validation_round():
    with pytest.raises(ValidationError, match="multiple of mix.val_interval"):
        RollstreamConfig(max_steps=30)


def test_defaults_are_the_papers():
    c = RollstreamConfig()
    assert (c.streams.group_size, c.streams.batch_size, c.streams.stale_ratio, c.streams.stale_step) == (8, 256, 0.25, 25)
    assert (c.agent_loop.max_turns, c.agent_loop.max_total_len, c.agent_loop.temperature) == (20, 8192, 0.8)
    assert (c.learner.lr, c.mix.val_interval, c.mix.val_group_size, c.streams.first_batch_factor) == (1e-6, 25, 4, 1.7)
    assert c.env_workers.count * c.env_workers.concurrency == 2048


def test_dispatcher_reads_the_runs_whole_configuration_so_its_split_sizes_are_the_env_workers(cfg, tmp_path):
    # A count in the file's `envs` (calc_rl_tasks) sizes the split the dispatcher draws indexes from.
    sized = cfg.model_copy(update={"envs": cfg.envs.model_copy(update={"calc_rl_tasks": 321})})
    child = dispatcher_child(sized, "r1", tmp_path)
    path = Path(_parse(child)["config"])
    write_private(path, child.files[str(path)])
    read = load_config(path)
    assert read.envs == sized.envs and read.kafka == sized.kafka
    assert [s.count for s in parse_sources("calc:rl", "train", envs=read.envs)] == [321]


def test_a_child_reads_the_runs_whole_configuration_so_an_override_of_the_file_does_not_break_it(tmp_path,
                                                                                                 monkeypatch):
    # configs/tiers.yaml sets val_interval 24; ROLLSTREAM_MAX_STEPS=72 over it is a valid run, while the
    # environment alone (val_interval's default 25) is not: every child must read the run's file.
    monkeypatch.setenv("ROLLSTREAM_MAX_STEPS", "72")
    cfg = load_config(REPO_ROOT / "configs" / "tiers.yaml")
    assert (cfg.max_steps, cfg.mix.val_interval) == (72, 24)
    with pytest.raises(Exception, match="multiple of mix.val_interval"):
        load_config()
    children = [streams_child(cfg, "r1", tmp_path, 6070),
                *env_worker_children(cfg, "r1", tmp_path, tmp_path / "model", URLS, cfg.envs),
                learner_child(cfg, "r1", tmp_path, tmp_path / "model", URLS, 29555)]
    for child in (with_run_config(c, cfg, tmp_path) for c in children):
        _parse(child)
        path = Path(child.argv[child.argv.index("--config") + 1])
        write_private(path, child.files[str(path)])
        assert load_config(path) == cfg, child.name
