"""`rollstream study` on the real stack, scaled down as far as a run goes: one variant under one
seed, a whole `rollstream up` run of a tiny fresh model; study.json has, per variant and family,
seeds, seeds_improved and mean_change, and the run got its seed and the variant's switch.

The policy is a freshly initialized small model: this is about the study's plumbing, not learning.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from helpers.policy import tiny_policy
from pipeline.run.config import REPO_ROOT

pytestmark = pytest.mark.integration

# One run of `up` (seed 0 of one variant: the aggregation over seeds is unit-tested) keeps CI short; the
# limit catches a hang.
STUDY_LIMIT_S = 2400


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy") / "model"
    tiny_policy(out, layers=1)
    return out


def _config(tmp: Path, model: Path) -> Path:
    # One engine, one env worker, one family; two learner steps between the two validation rounds.
    cfg = {
        "policy": {"path": str(model)},
        "engines": {"current": 1, "stale": 0, "max_model_len": 2048},
        "env_workers": {"count": 1, "concurrency": 8},
        "agent_loop": {"max_turns": 2, "max_total_len": 2048, "max_new_tokens": 32},
        "streams": {"group_size": 2, "batch_size": 2, "max_turns": 2, "first_batch_factor": 1.0,
                    "group_timeout_s": 300},
        "mix": {"families": ["calc"], "val_families": ["calc"], "val_samples": 2, "val_interval": 2,
                "val_group_size": 2},
        "max_steps": 2,
        "runs_dir": str(tmp / "runs"),
    }
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(STUDY_LIMIT_S + 300)
def test_a_study_runs_each_seed_and_reports_per_variant_and_family(infra, model, tmp_path):
    study = f"study-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "study", "--config", str(_config(tmp_path, model)),
                           "--seeds", "1", "--variants", "no-task-norm", "--study", study, "--json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=STUDY_LIMIT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout)
    folder = tmp_path / "runs" / study
    written = json.loads((folder / "study.json").read_text())
    assert printed["results"] == written["results"]
    assert written["failed"] == [], written["failed"]
    assert [(r["variant"], r["seed"], r["outcome"]) for r in written["runs"]] == [
        ("no-task-norm", 0, "finished")]
    calc = written["results"]["no-task-norm"]["calc"]
    assert calc["seeds"] == 1 and 0 <= calc["seeds_improved"] <= 1 and isinstance(calc["mean_change"], float)
    assert [c["seed"] for c in calc["changes"]] == [0]
    assert written["figure"] == "study.png" and (folder / "study.png").stat().st_size > 0
    # what the run was configured with, as `up` recorded it
    run_config = json.loads((tmp_path / "runs" / f"{study}-no-task-norm-s0" / "config.json").read_text())
    assert run_config["seed"] == 0 and run_config["streams"]["task_adv_norm"] is False
