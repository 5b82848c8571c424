"""`rollstream learner` under torchrun: 2 Gloo ranks against the real Kafka and MinIO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_learner_process import make_batch, produce, save_tiny_model, staged_tensors, weight_events

from learner import checkpoint
from learner.process import batch_items
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.engine.launch import free_port
from pipeline.policy.loading import load_policy
from schemas import objectstore

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=40, checkpoint_interval=1)


def torchrun(run: str, model_dir: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "pipeline.cli.learner", "--run-id", run, "--model", str(model_dir),
               "--lr", str(SETTINGS.lr), "--max-tokens-per-micro-batch", str(SETTINGS.max_tokens_per_micro_batch),
               "--checkpoint-interval", "1", "--quiet", *extra]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_start_refused_on_rank_0_ends_every_rank_at_once(infra, tmp_path):
    run = f"torchrun-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    first = subprocess.run([sys.executable, "-m", "pipeline.cli.learner", "--run", run, "--model", str(model_dir),
                            "--max-steps", "1", "--idle-exit", "1", "--quiet"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]

    started = time.monotonic()
    result = torchrun(run, model_dir, timeout=300)  # no --resume on a run with versions: ResumeError
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "rank 1: run already has versions up to 0" in result.stderr, result.stderr[-3000:]
    assert elapsed < 120  # not the Gloo timeout (30 minutes)


def test_two_fsdp_ranks_publish_and_checkpoint_the_whole_policy(infra, tmp_path):
    run = f"torchrun-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    batches = [make_batch(run, i) for i in range(2)]
    produce(infra, batches)
    result = torchrun(run, model_dir, "--parallelism", "fsdp", "--max-steps", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["version"] == 2

    events = weight_events(infra, run, 3)
    assert [e["version"] for e in events] == [0, 1, 2]
    model, ref, _ = load_policy(model_dir)
    optimizer = make_optimizer(model, SETTINGS)
    for b in batches:
        train_step(model, ref, optimizer, batch_items(b, fetch=lambda uri: b""), SETTINGS)
    mc = objectstore.client(infra.object_store)
    published = staged_tensors(mc, events[-1])
    assert "lm_head.weight" not in published  # tied: published once, as the embedding
    saved = checkpoint.load_latest(mc, run)
    assert saved is not None and (saved.state.step, saved.state.version) == (2, 2)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(published[name.replace("lm_head.", "model.embed_tokens.")], tensor,
                                   rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(saved.model[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert set(saved.optimizer["state"]) == {n for n, _ in model.named_parameters()}
