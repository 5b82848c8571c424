"""`rollstream eval` on the real stack, scaled down: a checkpoint directory is served by one current
engine, the held-out tasks of two families go through the router and the env workers, and the
tables come back: per task the success of each repeat with mean ± std (AgentRL Table 3) over
samples x n episodes, and termination-status shares that sum to one (Table 7). The policy is a
random small model: this checks the evaluation path, not a success rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.policy import tiny_policy
from pipeline.run.config import REPO_ROOT

pytestmark = pytest.mark.integration

SAMPLES, N = 2, 2


@pytest.mark.timeout(1800)
def test_eval_of_a_checkpoint_directory_reports_every_episode_per_task_and_repeat(infra, tmp_path: Path):
    model = tmp_path / "model"
    tiny_policy(model)
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "engines": {"current": 1, "stale": 0, "max_model_len": 4096},
        "env_workers": {"count": 1, "concurrency": 8},
        "agent_loop": {"max_turns": 2, "max_total_len": 4096, "max_new_tokens": 16},
        "streams": {"max_turns": 2},
        "runs_dir": str(tmp_path / "runs"),
    }))
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "eval", "--checkpoint", str(model), "--split", "std",
                           "--n", str(N), "--families", "calc,db", "--samples", str(SAMPLES), "--config", str(config),
                           "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["version"] == 0 and result["n"] == N and result["episodes"] == 2 * SAMPLES * N
    assert set(result["success"]) == {"calc", "db"}
    for row in result["success"].values():
        assert row["repeats"] == N and row["episodes"] == [SAMPLES] * N
        assert 0.0 <= row["mean"] <= 1.0 and row["std"] >= 0.0
    termination = result["termination"]
    assert termination["overall"]["episodes"] == 2 * SAMPLES * N
    for row in [*termination["tasks"].values(), termination["overall"]]:
        assert abs(sum(row["shares"].values()) - 1.0) < 1e-9
    leftovers = subprocess.run(["pgrep", "-af", result["run"]], capture_output=True, text=True).stdout.splitlines()
    assert [line for line in leftovers if "pgrep" not in line] == []
