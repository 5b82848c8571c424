"""`rollstream tensorboard` on the real broker: a run's events on `metrics` come back from TensorBoard's
own loader as scalars at their steps, the history and then what arrives live; other runs' do not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.analysis.tensorboard_scalars import tag_of
from pipeline.run.config import REPO_ROOT
from schemas import topics
from schemas.bus import EventProducer

pytestmark = pytest.mark.integration

IDLE_S = 4


def _metric(run: str, name: str, value: float, step: int | None, at_ms: int, source: str, **labels: str) -> dict:
    return {"run": run, "name": name, "value": value, "step": step, "labels": labels, "source": source, "at_ms": at_ms}


def _run_metrics(run: str, steps: range, t0_ms: int) -> list[dict]:
    """What the learner and the streams worker publish for `steps`: loss, KL and clip fraction per step, success
    per task (no step) half a second after each."""
    events = []
    for step in steps:
        at = t0_ms + step * 1000
        events += [_metric(run, "actor/loss", 1.0 / step, step, at, "learner"),
                   _metric(run, "actor/kl_loss", 1e-3 * step, step, at, "learner"),
                   _metric(run, "actor/pg_clipfrac", 0.1, step, at, "learner")]
        events += [_metric(run, "streams/success_rate", share * step, None, at + 500, "streams/metrics",
                           task=task, worker="w")
                   for task, share in (("db", 0.1), ("calc", 0.2))]
    return events


def _publish(kafka, events: list[dict]) -> None:
    with EventProducer(kafka) as producer:  # acknowledged by the broker on leaving
        for event in events:
            producer.send(topics.METRICS, event, key=event["name"])


def _command(run: str, logdir: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "tensorboard", "--run", run, "--logdir", str(logdir),
            "--until-idle", str(IDLE_S), "--json", *options]


def _series(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the folder's event files with its (step, value) points, read by TensorBoard."""
    loaded = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    loaded.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in loaded.Scalars(tag)] for tag in loaded.Tags()["scalars"]}


def _expected(steps: range) -> dict[str, list[tuple[int, float]]]:
    return {"actor/loss": [(s, round(1.0 / s, 6)) for s in steps],
            "actor/kl_loss": [(s, round(1e-3 * s, 6)) for s in steps],
            "actor/pg_clipfrac": [(s, 0.1) for s in steps],
            tag_of("streams/success_rate", {"task": "db", "worker": "w"}): [(s, round(0.1 * s, 6)) for s in steps],
            tag_of("streams/success_rate", {"task": "calc", "worker": "w"}): [(s, round(0.2 * s, 6)) for s in steps]}


def test_a_runs_history_reaches_tensorboard_with_loss_kl_and_success_per_task_at_their_steps(infra, tmp_path):
    run, other = f"tb-{uuid.uuid4().hex[:8]}", f"tb-other-{uuid.uuid4().hex[:8]}"
    t0 = int(time.time() * 1000)
    _publish(infra.kafka, _run_metrics(run, range(1, 4), t0) + _run_metrics(other, range(1, 6), t0))
    logdir = tmp_path / "tb"
    done = subprocess.run(_command(run, logdir), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert (summary["run"], summary["logdir"], summary["events"], summary["scalars"], summary["tags"]) == \
        (run, str(logdir), 15, 15, 5)
    assert summary["other_runs"] >= 25  # the other run's, and whatever else the topic holds
    assert _series(logdir) == _expected(range(1, 4))

    # Written again from the beginning, the run's scalars replace the earlier files: no point twice.
    again = subprocess.run(_command(run, logdir), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _series(logdir) == _expected(range(1, 4))


def test_following_writes_what_arrives_after_it_started_and_not_the_history(infra, tmp_path):
    run = f"tb-live-{uuid.uuid4().hex[:8]}"
    t0 = int(time.time() * 1000)
    _publish(infra.kafka, _run_metrics(run, range(1, 3), t0))
    logdir = tmp_path / "tb"
    follower = subprocess.Popen(_command(run, logdir, "--follow"), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        for line in follower.stderr:  # it says so once it reads from the topic's end
            if line.endswith("following\n"):
                break
        _publish(infra.kafka, _run_metrics(run, range(3, 5), t0))
        out, err = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err[-3000:]
    assert json.loads(out)["events"] == 10
    assert _series(logdir) == _expected(range(3, 5))
