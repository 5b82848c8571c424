"""`rollstream bench streams` scaled down: a real streams worker takes a few groups of 8k-token trajectories
at full speed and then at the paper's rate, through the command itself."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.bench.streams import PAPER_RATE
from pipeline.cli import app

pytestmark = pytest.mark.integration


def test_bench_streams_measures_capacity_latency_and_each_partys_cpu(infra):
    result = CliRunner().invoke(app, ["bench", "streams", "--groups", "8", "--window", "4",
                                     "--latency-seconds", "2", "--json"])
    assert result.exit_code == 0, f"{result.output[-3000:]}\n{result.exception!s}"
    report = json.loads(result.stdout.strip().splitlines()[-1])

    capacity, latency = report["capacity"], report["latency"]
    assert capacity["trajectories"] == 8 * 8 and capacity["batches"] >= 1
    assert report["ratio"] == pytest.approx(capacity["trajectories_per_s"] / PAPER_RATE)
    # the worker and the feeder did work; the worker's CPU per trajectory is its CPU seconds (rounded to 10 ms in
    # the report) over the trajectories it took
    assert capacity["cpu_seconds"]["workers"] > 0 and capacity["cpu_seconds"]["feeder"] > 0
    n = capacity["trajectories"]
    assert capacity["worker_cpu_ms_per_trajectory"] == pytest.approx(
        1000 * capacity["cpu_seconds"]["workers"] / n, abs=1000 * 0.005 / n)
    assert latency["rate"] == PAPER_RATE and latency["groups"] >= 2
    assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
