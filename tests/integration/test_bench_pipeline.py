"""`rollstream bench pipeline`, scaled down: one warm-up and one measured learner step per mode on the
real stack (the full run: `rollstream bench pipeline --steps 8`, BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from pipeline.run.config import REPO_ROOT

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1500)
def test_scaled_down_bench_pipeline_measures_both_modes_and_a_bound_from_the_stages_alone(infra, tmp_path: Path):
    config = yaml.safe_load((REPO_ROOT / "configs" / "pipeline.yaml").read_text())
    config |= {"runs_dir": str(tmp_path / "runs")}
    # The full run's heavy tails (up to 16 turns, 256 tokens a turn, 30 s a step, batches of 8 groups x 4) are
    # what makes the synchronous mode wait; scaled down, short ones keep both modes and the replay at a few
    # minutes while every phase, and every family's drawn shape, still runs on the real stack.
    loop = config["agent_loop"]
    loop |= {"max_turns": 4, "max_new_tokens": 32, "step_latency": {"median_s": 0.2, "sigma": 0.5, "max_s": 2.0}}
    for shape in loop["workload"]:
        shape["step_latency"] = loop["step_latency"]
    config["streams"] |= {"max_turns": 4, "group_size": 2, "batch_size": 3}
    config["mix"].pop("max_in_flight_groups")  # the dispatcher's default, two of these small batches
    # Fewer rollout slots: the rollout-alone run holds its learner until its warm-up (one group per
    # slot) and measured groups are ready, so 8 slots instead of 32 let it out after 12 groups, not 48.
    config["env_workers"]["concurrency"] = 4
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run = f"pipe-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "pipeline", "--steps", "1",
                           "--warmup-steps", "1", "--config", str(config_path), "--run", run, "--json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    for mode in ("sync", "async"):
        figures = report["modes"][mode]
        assert figures["trained_tokens_per_s"] > 0 and 0 < figures["engine_busy"] <= 1
        assert 0 < figures["cpu_busy"] <= 1.05 and figures["cpu_s_per_token"] > 0  # sampled, with the sampler's jitter
    assert report["ratio"] > 0 and report["of_bound"] > 0
    alone = report["stages_alone"]
    assert alone["rollout_tokens_per_s"] > 0 and alone["learner_tokens_per_s"] > 0
    assert alone["bound_tokens_per_s"] == min(alone["rollout_tokens_per_s"], alone["learner_tokens_per_s"])
    assert alone["cores_bound_tokens_per_s"] == pytest.approx(
        alone["cores"] / (alone["rollout_cpu_s_per_token"] + alone["learner_cpu_s_per_token"]))
    assert report["of_cores_bound"] >= report["of_bound"] > 0
    # the learner alone trained exactly the asynchronous mode's measured batches
    assert report["replay_differences"] == []
    assert Path(report["figure"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
