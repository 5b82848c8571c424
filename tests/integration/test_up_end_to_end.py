"""`rollstream up` on the real stack, scaled down: dispatcher → router → env workers → engines →
aggregator → batcher → learner → weight publish → engines on the new version; then the report,
`replay verify`, and nothing left running, every process authenticated to Kafka with SASL/SCRAM as a
user the test creates. And in the middle of a run (on the plaintext listener) every process answers on
its metrics port, and Ctrl-C stops it cleanly.

The policy is a freshly initialized small model: these tests are about the pipeline, not about
learning (the default run's report is where learning is measured).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers.policy import tiny_policy
from helpers.scram import client_environment, sasl_bootstrap, scram_user
from pipeline.run.config import REPO_ROOT
from schemas.prometheus import metrics_line

pytestmark = pytest.mark.integration

MAX_STEPS, STALE_STEP = 4, 3
# A fresh CI machine ran the whole suite 2.3x slower than a warm development one: the full run took
# more than 10 minutes there. The limit catches a hang, not a slow machine.
RUN_LIMIT_S = 1800


def _config(tmp: Path, model: Path, **overrides: object) -> Path:
    cfg = {
        "policy": {"path": str(model)},
        "engines": {"current": 1, "stale": 1, "max_model_len": 2048},
        "env_workers": {"count": 2, "concurrency": 8},
        "agent_loop": {"max_turns": 2, "max_total_len": 2048, "max_new_tokens": 32},
        "streams": {"group_size": 2, "batch_size": 2, "max_turns": 2, "stale_step": STALE_STEP,
                    "first_batch_factor": 1.0, "group_timeout_s": 300},
        "mix": {"families": ["calc", "db", "os"], "val_families": ["calc", "db"], "val_samples": 2,
                "val_interval": 2, "val_group_size": 2},
        "learner": {"lr": 1.0e-4, "checkpoint_interval": 2},
        "max_steps": MAX_STEPS,
        "runs_dir": str(tmp / "runs"),
        **overrides,
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy") / "model"
    tiny_policy(out)
    return out


def _left_running(run: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", run], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


@pytest.mark.timeout(RUN_LIMIT_S + 600)
def test_up_over_scram_trains_updates_both_pools_reports_and_replays_clean(infra, model, tmp_path):
    run = f"e2e-{uuid.uuid4().hex[:8]}"
    with scram_user(infra.kafka) as (user, password):
        env = {**os.environ, **client_environment(infra.kafka, user, password)}
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "up", "--config", str(_config(tmp_path, model)),
                               "--run", run, "--json", "--no-live"], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=RUN_LIMIT_S)
        assert done.returncode == 0, done.stderr[-4000:]
        summary = json.loads(done.stdout)
        verify = subprocess.run([sys.executable, "-m", "pipeline.cli", "replay", "verify", "--run", run, "--json",
                                 "--from", summary["started_at"]],
                                cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout[-4000:] + verify.stderr[-2000:]
    assert summary["outcome"] == "finished"
    progress = summary["progress"]
    assert progress["learner_version"] == MAX_STEPS and progress["learner_step"] == MAX_STEPS
    # Two speeds: the current pool holds the last version, the stale pool the last multiple of stale_step.
    pools = {e["pool"]: e["version"] for e in progress["engines"].values()}
    assert pools == {"current": MAX_STEPS, "stale": MAX_STEPS // STALE_STEP * STALE_STEP}
    assert set(progress["tasks"]) == {"calc", "db", "os"}
    assert all(v["done"] == v["requested"] > 0 for v in progress["validation"].values())
    assert all(code in (0, -signal.SIGTERM) for code in summary["exit_codes"].values()), summary["exit_codes"]
    assert _left_running(run) == []

    report = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert report["learner_steps"] == MAX_STEPS
    assert {"calc", "db"} <= set(report["tasks"])
    assert all((Path(summary["run_dir"]) / f).stat().st_size > 0 for f in report["figures"])

    # What every child process was given: the SCRAM listener and the user, in a file only its owner reads.
    given = Path(summary["run_dir"]) / "settings" / "config.json"
    kafka = json.loads(given.read_text())["kafka"]
    assert (kafka["bootstrap_servers"], kafka["security_protocol"], kafka["sasl_username"]) == (
        sasl_bootstrap(infra.kafka), "SASL_PLAINTEXT", user)
    assert given.stat().st_mode & 0o077 == 0


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    """The samples a process's metrics endpoint serves, by (name, labels)."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# A figure each kind of process sets once the learner has taken a step, and the least it must read then; each
# kind's figures are named rollstream_<kind>_...
SET_BY_FIRST_STEP = {
    "streams": (("rollstream_streams_sent_total", (("topic", "groups"),)), 1),
    "env-worker": (("rollstream_env_worker_tasks_in_flight", ()), 0),
    "learner": (("rollstream_learner_step", ()), 1),
    "dispatcher": (("rollstream_dispatcher_tasks_sent_total", (("kind", "train"),)), 1),
    "engine": (("rollstream_engine_healthy", ()), 1),
}


@pytest.mark.timeout(RUN_LIMIT_S)
def test_every_process_serves_its_metrics_while_the_run_lives_and_ctrl_c_stops_them_all(infra, model, tmp_path):
    run = f"e2e-int-{uuid.uuid4().hex[:8]}"
    config = _config(tmp_path, model, engines={"current": 1, "stale": 0, "max_model_len": 2048}, max_steps=40,
                     mix={"families": ["calc"], "val_families": [], "val_interval": 1})
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--config", str(config), "--run", run,
                             "--no-live", "--no-report"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "runs" / run / "logs"
    deadline = time.monotonic() + RUN_LIMIT_S - 400
    while not ((logs / "learner.log").exists() and "step 1 " in (logs / "learner.log").read_text(errors="replace")):
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "the learner never took a step"
        time.sleep(2)

    urls = json.loads((logs / "metrics_urls.json").read_text())
    assert set(urls) == {"streams", "env-worker-0", "env-worker-1", "learner", "dispatcher", f"{run}.current-0"}
    for name, url in urls.items():
        kind = "engine" if name.startswith(run) else name.rstrip("-0123456789")
        sample, least = SET_BY_FIRST_STEP[kind]
        samples = _samples(url)
        assert samples.get(sample, -1) >= least, (name, sample, sorted(samples)[:40])
        # its own figures only: another component's would read 0 here and mislead
        own = f"rollstream_{kind.replace('-', '_')}_"
        assert {n for n, _ in samples if n.startswith("rollstream_") and not n.startswith(own)} == set()

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-4000:]
    assert "interrupted" in err
    assert all(metrics_line(name, url) in err for name, url in urls.items())
    assert _left_running(run) == []
