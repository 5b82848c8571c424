"""The platform's subcommands, run in-process through the real CLI against the real services."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from schemas import topics

pytestmark = pytest.mark.integration
runner = CliRunner()


def test_smoke_round_trips_one_event_of_every_type_and_says_what_is_not_built(infra):
    result = runner.invoke(app, ["smoke", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["ok"] is True
    assert set(out["topics"]) == set(topics.ALL_TOPICS)
    assert all(r["equal"] for r in out["topics"].values())
    assert out["object_store_round_trip"] is True
    assert {item["issue"] for item in out["not_built"]} == {8}


def test_infra_status_lists_every_topic_with_its_declared_settings(infra):
    result = runner.invoke(app, ["infra", "status", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    t = info["kafka"]["topics"]
    assert all(t[name]["exists"] for name in topics.ALL_TOPICS)
    assert t["engines"]["config"]["cleanup.policy"] == "compact"
    assert all(t[name]["config"]["compression.type"] == "zstd" for name in topics.ALL_TOPICS)
    assert t["trajectories"]["config"]["max.message.bytes"] == "16777216"
    assert t["dlq"]["config"]["retention.ms"] == "-1"
    assert all(info["object_store"]["buckets"].values())
