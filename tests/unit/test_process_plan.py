"""`rollstream process NAME` starts each process of a run with the command line `rollstream up` gives it
(pipeline/run/plan.py process_child): checked against the real command tree, without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.run.config import load_config
from pipeline.run.plan import PROCESSES, Placement, dispatcher_child, process_child, streams_child
from tests.helpers.command_line import parse_rollstream

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "compose-test.yaml"
SUBCOMMAND = {"pipeline.cli.streams": "streams", "pipeline.cli.env_worker": "env-worker",
              "pipeline.cli.learner": "learner", "pipeline.cli.dispatch": "dispatch", "pipeline.cli.engine": "engine"}


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


def _parsed(argv: tuple[str, ...]) -> tuple[str, dict]:
    assert argv[1] == "-m"
    return parse_rollstream([SUBCOMMAND[argv[2]], *argv[3:]])


@pytest.mark.parametrize("name", PROCESSES)
def test_every_process_command_is_accepted_by_the_real_command_line(cfg, name):
    child = process_child(cfg, name, Path("/runs/r"), Path("/models/p"), Placement())
    _parsed(child.argv)


def test_the_learner_always_resumes_and_broadcasts_from_its_service_name(cfg):
    placement = Placement(engine_urls={"current": ["http://a:8000"], "stale": ["http://b:8000"]},
                          broadcast_host="learner", broadcast_port=29600)
    _, params = _parsed(process_child(cfg, "learner", Path("/runs/r"), Path("/models/p"), placement).argv)
    assert params["resume"] is True
    assert (params["broadcast_host"], params["broadcast_port"]) == ("learner", 29600)
    assert (params["broadcast_current"], params["broadcast_stale"]) == ("http://a:8000", "http://b:8000")
    assert params["max_steps"] == cfg.max_steps


def test_an_engine_serves_every_interface_and_takes_the_runs_engine_options(cfg):
    placement = Placement(pool="stale", advertise_host="engine-stale", port=8100)
    _, params = _parsed(process_child(cfg, "engine", Path("/runs/r"), Path("/models/p"), placement).argv)
    assert (params["pool"].value, params["host"], params["port"]) == ("stale", "0.0.0.0", 8100)
    assert params["advertise_url"] == "http://engine-stale:8100"
    assert (params["stale_step"], params["max_model_len"]) == (cfg.streams.stale_step, cfg.engines.max_model_len)
    assert params["engine_id"] == f"{cfg.run}.stale"


def test_scaled_env_workers_get_ids_of_their_own(cfg):
    ids = {_parsed(process_child(cfg, "env-worker", Path("/runs/r"), Path("/models/p"),
                                 Placement(worker_id=w)).argv)[1]["worker_id"] for w in ("", "w1", "w2")}
    assert len(ids) == 3


def test_streams_and_dispatcher_are_the_ones_up_starts(cfg):
    run_dir = Path("/runs/r")
    assert process_child(cfg, "streams", run_dir, Path("/m"), Placement()) == streams_child(cfg, cfg.run, run_dir, 6066)
    assert process_child(cfg, "dispatcher", run_dir, Path("/m"), Placement()) == dispatcher_child(cfg, cfg.run, run_dir)


def test_an_unknown_process_is_refused_with_the_names_to_choose_from(cfg):
    with pytest.raises(ValueError, match="choose from streams, env-worker"):
        process_child(cfg, "trainer", Path("/runs/r"), Path("/m"), Placement())
