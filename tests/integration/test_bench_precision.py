"""`rollstream bench precision` scaled down: a float32 and a bfloat16 engine serve a tiny policy, the learner
scores their tokens and trains under both compute dtypes, through the command itself."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.helpers.policy import tiny_policy

pytestmark = pytest.mark.integration


def test_bench_precision_measures_both_dtypes_and_how_far_the_learner_is_from_each_engine(infra, tmp_path):
    model_dir = tiny_policy(tmp_path / "policy")
    result = CliRunner().invoke(app, ["bench", "precision", "--model", str(model_dir), "--requests", "2",
                                     "--concurrency", "2", "--max-new-tokens", "8", "--learner-steps", "1", "--json"])
    assert result.exit_code == 0, f"{result.output[-3000:]}\n{result.exception!s}"
    report = json.loads(result.stdout.strip().splitlines()[-1])

    for stage in ("engine", "learner"):
        assert set(report[stage]) == {"float32", "bfloat16"}
        assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in report[stage].values())
    assert report["engine"]["float32"]["tokens"] == report["engine"]["bfloat16"]["tokens"] == 2 * 8
    assert report["ratio"] == pytest.approx(report["engine"]["bfloat16"]["tokens_per_s"]
                                            / report["engine"]["float32"]["tokens_per_s"])
    pairs = {(a["engine"], a["learner"]): a for a in report["agreement"]}
    assert set(pairs) == {(e, l) for e in ("float32", "bfloat16") for l in ("float32", "bfloat16")}
    assert all(a["tokens"] == 16 for a in pairs.values())
    # A float32 engine and a float32 learner compute the same log-probs up to float32 rounding; bfloat16 on
    # either side moves them by bfloat16's rounding (8 bits of mantissa), orders of magnitude more.
    assert pairs["float32", "float32"]["max_abs"] < 1e-3
    assert pairs["bfloat16", "float32"]["mean_abs"] > pairs["float32", "float32"]["mean_abs"]
    assert report["auto"]["engines"] in ("float32", "bfloat16")
