"""`rollstream bench weights`'s pure part: per-setting delta fractions and the headline ratio."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.bench.weights_logic import MB, baseline, setting_summary, update_summary, version_row
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


def test_bench_weights_refuses_a_model_path_without_a_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["bench", "weights", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a checkpoint directory" in result.output
