"""`rollstream bench peer` scaled down on the real stack: a tiny policy trained one step by rollstream (`up`:
one engine, the Faust worker, an env worker, the learner, the dispatcher) and one step by TRL's GRPOTrainer
(its rollouts calling rollstream's calc environment), then `rollstream eval` of the starting policy and of both
final checkpoints on the same held-out samples. Both sides must have taken every optimizer step on full batches
of policy tokens, and the comparison must be computed. The policy is random: this checks that both sides train
and are measured alike, not which learns more.
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
from pipeline.bench.peer_logic import FIXED_DIFFERENCES
from pipeline.run.config import REPO_ROOT

pytestmark = pytest.mark.integration

STEPS, GROUP, PROMPTS, SAMPLES = 1, 2, 2, 2


@pytest.mark.timeout(1800)
def test_both_sides_train_every_step_and_the_comparison_is_computed(infra, tmp_path: Path):
    model = tiny_policy(tmp_path / "policy")
    config = tmp_path / "peer.yaml"
    config.write_text(yaml.safe_dump({
        "engines": {"current": 1, "stale": 0, "max_model_len": 4096},
        "env_workers": {"count": 1, "concurrency": 8},
        "agent_loop": {"max_turns": 2, "max_total_len": 4096, "max_new_tokens": 16},
        "streams": {"group_size": GROUP, "batch_size": PROMPTS, "max_turns": 2, "first_batch_factor": 1.0,
                    "group_timeout_s": 300},
        "mix": {"families": ["calc:rl"], "val_families": []},
        "learner": {"lr": 1.0e-4},
        "runs_dir": str(tmp_path / "runs"),
    }))
    run = f"peer-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "peer", "--steps", str(STEPS),
                           "--samples", str(SAMPLES), "--n", "1", "--model", str(model), "--config", str(config),
                           "--run", run, "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    result = json.loads(done.stdout)
    print(json.dumps({k: v for k, v in result.items() if k not in ("differences",)}, indent=1, default=str),
          file=sys.stderr)

    for side in ("rollstream", "peer"):
        row = result[side]
        assert row["steps"] == STEPS, (side, row)
        assert row["trajectories"] == STEPS * PROMPTS * GROUP, (side, row)
        assert row["trained_tokens"] > 0 and row["trained_tokens_per_s"] > 0, (side, row)
        assert row["peak_memory_bytes"] > 0 and row["wall_s"] > 0, (side, row)
        assert 0 < row["cpu_busy"] <= 1.05 and row["cpu_s_per_token"] > 0, (side, row)
        assert [p["step"] for p in row["curve"]] == list(range(1, STEPS + 1)), (side, row["curve"])
        assert (Path(row["checkpoint"]) / "config.json").is_file()
        held = row["held_out"]
        assert held["episodes"] == [SAMPLES, SAMPLES], (side, held)  # the same before, n = 1
        assert held["change"] is not None and held["change"]["samples"] == SAMPLES
    assert result["ratio"] == pytest.approx(result["rollstream"]["trained_tokens_per_s"]
                                            / result["peer"]["trained_tokens_per_s"])
    # the ratio's two factors, measured over the same windows, multiply back to it (up to the sampler's edges)
    assert result["cpu_per_token_ratio"] * result["cpu_busy_ratio"] == pytest.approx(result["ratio"], rel=0.05)
    assert result["matched"]["group_size"] == GROUP and result["matched"]["prompts_per_step"] == PROMPTS
    assert result["differences"][:len(FIXED_DIFFERENCES)] == list(FIXED_DIFFERENCES)
    assert Path(result["figure"]).read_bytes()[:4] == b"\x89PNG"
    leftovers = subprocess.run(["pgrep", "-af", run], capture_output=True, text=True).stdout.splitlines()
    assert [line for line in leftovers if "pgrep" not in line] == []
