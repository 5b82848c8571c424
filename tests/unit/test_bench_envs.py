"""`rollstream bench envs`: a small real run over the fast families, and families that cannot run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest
from typer.testing import CliRunner

from env_workers.envs.base import Environment, Opened, Outcome, Session, ToolCall
from pipeline.bench import envs_logic
from pipeline.cli import app

RUNNER = CliRunner()


def test_json_reports_each_family_beside_the_bare_process_and_their_ratio() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc,webshop", "--sessions", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"bare_process", "families", "median_family_p50_ms", "ratio"}
    bare = report["bare_process"]
    assert bare["command"] == "/bin/true" and bare["p50_ms"] > 0 and bare["per_s"] > 0
    assert set(report["families"]) == {"calc", "webshop"}
    for figures in report["families"].values():
        assert figures["measured"] and figures["sessions"] == 3
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] and figures["sessions_per_s"] > 0
    p50s = sorted(f["p50_ms"] for f in report["families"].values())
    assert report["median_family_p50_ms"] == pytest.approx(sum(p50s) / 2)
    assert report["ratio"] == pytest.approx(report["median_family_p50_ms"] / bare["p50_ms"])


def test_table_is_the_default_output() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc", "--sessions", "2"])
    assert result.exit_code == 0
    assert "bare /bin/true" in result.output and "calc" in result.output and "ratio" in result.output


def test_unknown_family_is_one_line_and_a_nonzero_exit() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc,chess"])
    assert result.exit_code == 2 and "unknown families ['chess']" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_os_is_measured_once_per_sandbox_backend() -> None:
    assert [label for label, _, _ in envs_logic.labels(["calc", "os"])] == ["calc", "os/docker", "os/bwrap"]


class _SlowEnvironment(Environment):
    family = "slow"

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        await asyncio.sleep(5)
        return Opened([], [])

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        raise AssertionError("not called")


def _missing() -> tuple[Environment, list[dict[str, Any]]]:
    raise ModuleNotFoundError("No module named 'env_workers.envs.os_env'")


def test_a_family_that_cannot_start_or_takes_too_long_is_reported_not_measured() -> None:
    missing = asyncio.run(envs_logic.measure(_missing, 2, 1, 10.0))
    assert missing == {"measured": False,
                       "reason": "ModuleNotFoundError: No module named 'env_workers.envs.os_env'"}
    slow = asyncio.run(envs_logic.measure(lambda: (_SlowEnvironment(1), [{"id": 0}]), 2, 1, 0.2))
    assert slow == {"measured": False, "reason": "did not finish within 0.2 s"}
