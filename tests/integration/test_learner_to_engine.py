"""Weight publishing end to end: a real learner process trains on real `batches` events and each
new version reaches a real vLLM engine, once by broadcast (the fast path, Gloo on CPU) and once
from MinIO (the staged path, the engine following `weights`). After each, the engine's greedy
tokens equal a transformers forward pass of the learner's published weights, and its sampling
log-probs match that forward pass's temperature-scaled log-softmax."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers.vllm import serving_engine
from transformers import AutoModelForCausalLM

from env_workers.engine_client import (
    WEIGHT_VERSION_HEADER,
    completion_request,
    parse_completion,
)
from learner.manifest import read_version
from pipeline.engine.launch import free_port
from pipeline.engine.updates import download_version
from pipeline.policy.model_init import PolicyModelSettings, build_tokenizer, init_model
from schemas import arrays, objectstore, samples, topics
from schemas.bus import EventConsumer, EventProducer
from schemas.template import template_fingerprint

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
# Bytes only: the batches below are random byte ids, fingerprinted with the bytes-only tokenizer.
TINY = PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256, vocab_size=256)
PROMPT = [257, 104, 101, 108, 108, 111]  # <|im_start|> then "hello" as bytes
TEMPERATURE = 0.8
LOGPROB_TOLERANCE = 1e-4


def _batch(run: str, index: int) -> dict:
    """A batches event whose trajectories reward a fixed continuation, so a large learning rate
    moves the weights far enough to change greedy choices."""
    rng = np.random.default_rng(index)
    items = []
    for member in range(4):
        t = samples.trajectory(member=member, num_tokens=24)
        mask = np.zeros(24, dtype=np.uint8)
        mask[t["prompt_tokens"]:] = 1
        t.update(run=run, group_id=f"{run}-g{index}", trajectory_id=f"{run}-t{index}-{member}",
                 template_fingerprint=template_fingerprint(build_tokenizer()),
                 input_ids=arrays.pack_ids(rng.integers(0, 256, 24)), loss_mask=arrays.pack_mask(mask),
                 rollout_logprobs=arrays.pack_logprobs(-np.ones(24) * mask))
        items.append({"trajectory": t, "group_advantage": 1.0, "advantage": 1.0 if member % 2 else -1.0})
    return {**samples.batch(), "batch_id": f"{run}-b{index}", "run": run, "index": index,
            "group_ids": [f"{run}-g{index}"], "items": items}


def _weights_events(infra, run: str, count: int, timeout_s: float = 60) -> list[dict]:
    consumer = EventConsumer(infra.kafka, group_id=f"check-{uuid.uuid4().hex}", topic_names=[])
    consumer.assign({topics.WEIGHTS: {p: 0 for p in consumer.end_offsets(topics.WEIGHTS)}})
    found, deadline = [], time.monotonic() + timeout_s
    while len(found) < count and time.monotonic() < deadline:
        e = consumer.poll(0.5)
        if e is not None and e.value["run"] == run:
            found.append(e.value)
    consumer.close()
    return found


def _published(infra, event: dict, directory: Path) -> dict[str, torch.Tensor]:
    """The weights a `weights` event announces, as an engine downloads them (a delta version is
    rebuilt on its chain, every tensor checked against its sha256)."""
    download_version(objectstore.client(infra.object_store), event, directory)
    return read_version(directory)[1]


def _torch_model(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model


def _torch_greedy(model: torch.nn.Module, count: int) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def _engine(url: str, model_dir: Path, count: int, temperature: float) -> tuple[list[int], list[float], int]:
    body = completion_request(str(model_dir), PROMPT, count, temperature, []) | {"ignore_eos": True, "seed": 7}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    ids, logprobs, _ = parse_completion(response.json(), "test")
    return ids, logprobs, int(response.headers[WEIGHT_VERSION_HEADER])


def _max_logprob_gap(model: torch.nn.Module, ids: list[int], logprobs: list[float]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1]  # (len(ids), V)
    expected = torch.log_softmax(logits / TEMPERATURE, dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
    return float((expected - torch.tensor(logprobs)).abs().max())


def _learner(run: str, model_dir: Path, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli.learner", "--run", run, "--model", str(model_dir),
                             "--lr", "0.01", "--checkpoint-interval", "1", "--quiet", "--json", *args],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_each_version_reaches_the_engine_by_broadcast_or_from_minio_and_matches_the_learner(infra, tmp_path):
    run = f"publish-{uuid.uuid4().hex[:8]}"
    model_dir = tmp_path / "policy"
    init_model(TINY, model_dir)
    with serving_engine(model_dir, tmp_path / "engines", run=run,
                        args=("--max-model-len", "1024", "--heartbeat-s", "1", "--dtype", "float32")) as (engine, _):
        before, _, version = _engine(engine.url, model_dir, 16, 0.0)
        assert version == 0

        # Fast path: the learner broadcasts version 1 to the current pool.
        with EventProducer(infra.kafka) as producer:
            producer.send(topics.BATCHES, _batch(run, 0), key=f"{run}-b0")
        out = _learner(run, model_dir, "--max-steps", "1", "--broadcast-current", engine.url,
                       "--broadcast-port", str(free_port()))
        assert out["version"] == 1
        events = _weights_events(infra, run, 2)
        assert [(e["version"], e["broadcast_pools"]) for e in events] == [(0, ["current"]), (1, ["current"])]
        # Staged as a delta on version 0 (learner.snapshot_interval): the chain is what MinIO holds.
        assert all("/delta-" in s["uri"] for s in events[1]["shards"])
        model = _torch_model(model_dir, _published(infra, events[1], tmp_path / "v1"))
        greedy, _, version = _engine(engine.url, model_dir, 16, 0.0)
        assert version == 1
        assert greedy == _torch_greedy(model, 16)
        assert greedy != before  # the step really changed the policy
        ids, logprobs, _ = _engine(engine.url, model_dir, 32, TEMPERATURE)
        assert _max_logprob_gap(model, ids, logprobs) < LOGPROB_TOLERANCE

        # Staged path: the resumed learner has no broadcast; the engine loads version 2 from MinIO.
        with EventProducer(infra.kafka) as producer:
            producer.send(topics.BATCHES, _batch(run, 1), key=f"{run}-b1")
        out = _learner(run, model_dir, "--resume", "--max-steps", "2")
        assert out["version"] == 2
        events = _weights_events(infra, run, 3)
        assert (events[2]["version"], events[2]["broadcast_pools"]) == (2, [])
        deadline = time.monotonic() + 60
        while httpx.get(f"{engine.url}/rollstream/state", timeout=5).json()["version"] != 2:
            assert time.monotonic() < deadline, f"engine did not load version 2 from MinIO:\n{engine.log_tail()}"
            time.sleep(0.5)
        model = _torch_model(model_dir, _published(infra, events[2], tmp_path / "v2"))
        greedy2, _, version = _engine(engine.url, model_dir, 16, 0.0)
        assert version == 2
        assert greedy2 == _torch_greedy(model, 16)
        ids, logprobs, _ = _engine(engine.url, model_dir, 32, TEMPERATURE)
        assert _max_logprob_gap(model, ids, logprobs) < LOGPROB_TOLERANCE
