"""`rollstream bench weights`'s pure part: per-setting delta fractions and the headline ratio."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.bench.weights_logic import MB, baseline, engine_split, setting_summary, update_summary, version_row
from pipeline.cli import app


def test_delta_fraction_is_the_mean_over_delta_versions_only():
    rows = [version_row(0, "full", 1000, 1000, 0.1), version_row(1, "delta", 50, 1000, 0.01),
            version_row(2, "delta", 30, 1000, 0.01)]
    summary = setting_summary("bfloat16", 1e-6, rows, {"bit_identical": True})
    assert summary["delta_fraction"] == pytest.approx(0.04)
    assert summary["delta_fraction_max"] == pytest.approx(0.05)
    assert (summary["dtype"], summary["lr"], summary["late_join"]) == ("bfloat16", 1e-6, {"bit_identical": True})


def test_a_setting_without_deltas_has_no_fraction():
    assert setting_summary("float32", 1e-4, [version_row(0, "full", 10, 10, 0.1)], {})["delta_fraction"] is None


def test_ratio_is_update_bandwidth_over_the_copy_baseline_of_the_same_bytes():
    base = baseline(100 * MB, copy_s=0.1, write_s=0.4, read_s=0.5)
    assert base["seconds"] == pytest.approx(1.0) and base["mb_per_s"] == pytest.approx(100)
    update = update_summary(100 * MB, [2.0, 1.5, 2.5], base)
    assert update["median_s"] == 2.0
    assert update["mb_per_s"] == pytest.approx(50)
    assert update["ratio"] == pytest.approx(0.5)  # exactly "within 2x"


def test_the_engines_split_of_each_in_memory_update_is_read_from_its_log():
    log = ("[engine] loaded version 2 from MinIO in memory (1 delta(s) on version 1): download 0.40 s, drain 0.01 s, "
           "apply 1.20 s, load 2.05 s\n"
           "[engine] loaded version 3 from MinIO (rebuilt on disk)\n"
           "[engine] loaded version 4 from MinIO in memory (2 delta(s) on version 2): download 0.10 s, drain 0.00 s, "
           "apply 0.90 s, load 1.75 s\n")
    assert engine_split(log) == [
        {"version": 2, "download_s": 0.4, "drain_s": 0.01, "apply_s": 1.2, "load_s": 2.05},
        {"version": 4, "download_s": 0.1, "drain_s": 0.0, "apply_s": 0.9, "load_s": 1.75}]
    assert engine_split("") == []


def test_bench_weights_refuses_a_model_path_without_a_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["bench", "weights", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a checkpoint directory" in result.output
