"""Kill the learner (SIGKILL) mid-run and resume: continuous versions, every batch applied once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_learner_process import make_batch, produce, save_tiny_model, staged_tensors, weight_events

from learner.checkpoint import TrainingState
from learner.process import Published, batch_items, plan_resume
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.policy.loading import load_policy
from schemas import objectstore

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=64, checkpoint_interval=1)


def start_learner(run: str, model_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli.learner", "--run", run, "--model", str(model_dir),
               "--checkpoint-interval", "1", "--lr", "1e-3", "--max-tokens-per-micro-batch", "64",
               "--idle-exit", "90", "--quiet", *extra]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.integration
def test_learner_killed_mid_run_resumes_with_every_batch_applied_exactly_once(infra, tmp_path):
    run = f"resume-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    batches = [make_batch(run, i) for i in range(8)]

    first = start_learner(run, model_dir, tmp_path / "first.log")
    try:
        for i in range(3):  # one at a time: each trained before the next arrives
            produce(infra, [batches[i]])
            assert len(weight_events(infra, run, i + 2)) == i + 2, (tmp_path / "first.log").read_text()
        produce(infra, batches[3:5])
        while len(weight_events(infra, run, 5, timeout=10)) < 5:  # kill while batch 3 or 4 is in flight
            pass
        time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()

    second = start_learner(run, model_dir, tmp_path / "second.log", "--resume")
    try:
        produce(infra, batches[5:])
        events = weight_events(infra, run, 9, timeout=90)
        assert len(events) == 9, (tmp_path / "second.log").read_text()
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    log = (tmp_path / "second.log").read_text()
    assert "resumed from checkpoint" in log
    assert "checkpointing step 8" in log  # SIGTERM checkpoints before exiting

    events = weight_events(infra, run, 9)
    assert [e["version"] for e in events] == list(range(9))
    assert [e["batch_id"] for e in events[1:]] == [b["batch_id"] for b in batches]

    # An uninterrupted run over the same batches, in this process, ends at the same weights.
    model, ref, _ = load_policy(model_dir)
    optimizer = make_optimizer(model, SETTINGS)
    for b in batches:
        train_step(model, ref, optimizer, batch_items(b, fetch=lambda uri: b""), SETTINGS)
    final = staged_tensors(objectstore.client(infra.object_store), events[-1])
    for name, tensor in model.state_dict().items():  # the tied lm_head is published as the embedding
        torch.testing.assert_close(final[name.replace("lm_head.", "model.embed_tokens.")], tensor,
                                   rtol=1e-5, atol=1e-6, msg=name)


def test_resume_after_uncheckpointed_steps_continues_numbering_and_reports_them_lost():
    published = [Published(0, 0, None), Published(1, 1, "b1"), Published(2, 2, "b2"), Published(3, 3, "b3")]
    ckpt = TrainingState(step=1, version=1, offsets={0: 5}, applied_batch_ids=["b1"])
    plan = plan_resume(published, ckpt, resume=True)
    assert plan.lost_versions == (2, 3)
    assert (plan.state.version, plan.state.step) == (3, 3)
    assert plan.state.applied_batch_ids == ["b1", "b2", "b3"]  # lost, but never trained twice
    assert plan.state.offsets == {0: 5}
    assert not plan.publish_initial and not plan.announce_checkpoint_version


def test_resume_announces_a_version_checkpointed_before_its_event():
    published = [Published(0, 0, None), Published(1, 1, "b1")]
    ckpt = TrainingState(step=2, version=2, offsets={0: 9}, applied_batch_ids=["b1", "b2"])
    plan = plan_resume(published, ckpt, resume=True)
    assert plan.announce_checkpoint_version and plan.lost_versions == ()
    assert plan.state.version == 2


def test_first_start_publishes_the_initial_version():
    plan = plan_resume([], None, resume=True)
    assert plan.publish_initial and plan.state.version == 0
    assert plan.state == TrainingState()
