"""`rollstream bench rollout` end to end on a tiny policy: a real engine, a real env worker publishing to
Kafka, and weight updates by broadcast and from MinIO, through the command itself."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.policy.model_init import PolicyModelSettings, init_model

pytestmark = pytest.mark.integration

TINY = PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                           vocab_size=256)


def test_bench_rollout_publishes_every_turn_and_trajectory_and_updates_the_engine_by_both_paths(infra, tmp_path):
    model_dir = tmp_path / "policy"
    init_model(TINY, model_dir)
    result = CliRunner().invoke(app, ["bench", "rollout", "--model", str(model_dir), "--trajectories", "4",
                                     "--concurrency", "4", "--max-new-tokens", "16", "--json"])
    assert result.exit_code == 0, f"{result.output[-3000:]}\n{result.exception!s}"
    report = json.loads(result.stdout.strip().splitlines()[-1])

    loop, alone = report["loop"], report["engine_alone"]
    assert loop["trajectories"] == 4 and sum(report["statuses"].values()) == 4
    # Every trajectory and every finished turn rolled out was published and read back under the bench run.
    assert report["events"]["trajectories"] == loop["trajectories"]
    assert report["events"]["steps"] == loop["turns"] > 0
    assert report["events"]["flush_s"] >= 0.0
    chained = report["engine_chained"]
    assert alone["tokens"] == chained["tokens"] == loop["tokens"]
    assert alone["turns"] == chained["turns"] == loop["turns"]
    assert report["ratio"] == pytest.approx(loop["tokens_per_s"] / alone["tokens_per_s"])
    assert report["ratio_chained"] == pytest.approx(loop["tokens_per_s"] / chained["tokens_per_s"])
    # Where the CPU went in each phase: the engine's tree worked in all three, the loop's process in phase 1.
    for phase in ("loop", "engine_alone", "engine_chained"):
        cpu, engine = report["cpu"][phase], report["engine"][phase]
        assert cpu["engine_cpu_s"] > 0 and cpu["engine_ms_per_token"] > 0 and 0 < cpu["machine_busy_share"] <= 1.05
        assert cpu["loop_thread_wait_s"] >= 0
        assert engine["steps"] > 0 and engine["ms_per_step"] > 0 and engine["mean_requests_inside"] > 0
    assert report["cpu"]["loop"]["loop_cpu_s"] > 0
    assert report["loop_cpu_share"] == pytest.approx(report["cpu"]["loop"]["loop_ms_per_token"]
                                                     / report["cpu"]["engine_alone"]["engine_ms_per_token"])
    turn = report["time_per_turn"]
    assert turn["generate_ms"] > 0 and turn["environment_ms"] >= 0
    assert "Kafka" not in report["left_out"]

    [update] = report["weight_updates"]
    assert update["model"] == "default" and update["bytes"] > 0
    # The engine reported the broadcast version, then the staged one.
    assert (update["broadcast"]["version"], update["staged"]["version"]) == (2, 3)
    for path in ("broadcast", "staged", "memory_copy", "tensor_clone", "file_read"):
        figures = update[path]
        assert figures["seconds"] > 0 and figures["mb_per_s"] > 0, path
    assert update["broadcast"]["bytes"] == update["memory_copy"]["bytes"] == update["bytes"]
    assert update["staged"]["bytes"] == update["file_read"]["bytes"] > update["bytes"]  # safetensors headers
    assert update["staged"]["stage_seconds"] + update["staged"]["load_seconds"] == pytest.approx(
        update["staged"]["seconds"])


def test_bench_rollout_refuses_a_non_positive_count_in_one_line():
    result = CliRunner().invoke(app, ["bench", "rollout", "--trajectories", "0"])
    assert result.exit_code == 2
    assert result.output.strip() == ("rollstream bench rollout: --trajectories, --concurrency and --max-new-tokens "
                                     "must be positive")


def test_bench_rollout_refuses_more_tasks_than_the_mix_holds_in_one_line():
    result = CliRunner().invoke(app, ["bench", "rollout", "--trajectories", "100000"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("rollstream bench rollout: --trajectories 100000 is more than the ")
    assert len(result.output.strip().splitlines()) == 1
