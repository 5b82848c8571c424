"""An engine of a run serves under the run's model id, also when it restarts on a later version's
directory: the env workers send the id they read at start, and vLLM answers any other with 404 (found
by `bench chaos`: after an engine_kill, the restarted current engine served under its restart
directory's path and every request to it was refused)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pipeline.policy.loading as loading
import pipeline.run.engines as engines
from pipeline.engine.server import vllm_command
from pipeline.run.config import RollstreamConfig, load_config


def test_the_served_name_becomes_vllms_served_model_name_and_none_leaves_vllms_default():
    named = vllm_command("/runs/r/engines/e.restart/v000019", host="127.0.0.1", port=1, max_model_len=64,
                         dtype="float32", enforce_eager=True, served_name="/models/policy")
    assert named[named.index("--served-model-name") + 1] == "/models/policy"
    plain = vllm_command("/models/policy", host="127.0.0.1", port=1, max_model_len=64, dtype="float32",
                         enforce_eager=True)
    assert "--served-model-name" not in plain


def test_an_engine_restarted_on_a_later_version_keeps_the_runs_model_id_and_its_cores(monkeypatch, tmp_path: Path):
    launched = {}
    monkeypatch.setattr(loading, "materialize_version", lambda cfg, run, version, model_dir, out: out / "v000019")
    monkeypatch.setattr(engines, "stop_listener", lambda port: None)
    monkeypatch.setattr(engines, "launch_run_engine",
                        lambda cfg, run, run_dir, model_dir, pool, engine_id, port, extra, metrics_port, cpus:
                        launched.update(model_dir=model_dir, extra=extra, cpus=cpus))
    restarter = engines.EngineRestarter(RollstreamConfig(), "r", tmp_path, Path("/models/policy"), print)
    dead = SimpleNamespace(engine_id="r.current-0", pool="current", url="http://127.0.0.1:8100", metrics_port=None,
                           cpus="1")
    restarter._start(dead, 19)
    assert launched["model_dir"].name == "v000019"
    extra = launched["extra"]
    assert extra[extra.index("--served-name") + 1] == "/models/policy"
    assert extra[extra.index("--initial-version") + 1] == "19"
    assert launched["cpus"] == "1"


def test_an_engine_of_a_run_reads_the_runs_whole_configuration(monkeypatch, tmp_path: Path):
    launched = {}
    monkeypatch.setattr(engines, "launch_engine", lambda **kwargs: launched.update(kwargs))
    cfg = RollstreamConfig(max_steps=48, mix={"val_interval": 24})  # not what the environment alone gives
    engines.launch_run_engine(cfg, "r", tmp_path, Path("/models/policy"), "current", "r.current-0")
    extra = launched["extra_args"]
    path = Path(extra[extra.index("--config") + 1])
    assert load_config(path) == cfg
