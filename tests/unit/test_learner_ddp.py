"""Two Gloo ranks with DDP take the same step as one process on the same batch."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.distributed import ddp_train_step, rank_share, share_batch, sync_from_leader
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step

# A budget that makes 5 micro-batches of the batch below: uneven over 2 ranks, so one rank pads.
SETTINGS = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=40)


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=128)
    return Qwen2ForCausalLM(config)


def batch(seed: int) -> list:
    rng = np.random.default_rng(seed)
    items = []
    for advantage in (1.0, -0.5, 2.0, -1.5, 0.7, 0.3, -1.0):
        n = int(rng.integers(12, 30))
        mask = np.zeros(n, dtype=np.uint8)
        mask[int(rng.integers(3, n - 4)):] = 1
        logprobs = (-rng.exponential(1.0, n) * mask).astype(np.float32)
        items.append((rng.integers(0, 300, n).astype(np.int32), mask, logprobs, advantage))
    return items


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = tiny_model()
        if rank == 1:  # a rank that starts from different weights is brought in line by rank 0
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        ref = copy.deepcopy(model)
        optimizer = make_optimizer(model, SETTINGS)
        sync_from_leader(model, optimizer)
        ref.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model)
        metrics = []
        for seed in (1, 2):  # two steps: the second one uses AdamW's moments from the first
            items = share_batch(batch(seed) if rank == 0 else None)
            metrics.append(ddp_train_step(ddp, ref, optimizer, items, SETTINGS))
        torch.save({"state": model.state_dict(), "metrics": metrics}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_trains_its_round_robin_share_and_pads_to_equal_passes():
    assert rank_share(5, 2, 0) == [(0, 1.0), (2, 1.0), (4, 1.0)]
    assert rank_share(5, 2, 1) == [(1, 1.0), (3, 1.0), (1, 0.0)]
    assert rank_share(1, 2, 1) == [(0, 0.0)]


def test_two_gloo_ranks_equal_a_single_process_step(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)

    model = tiny_model()
    ref = copy.deepcopy(model)
    optimizer = make_optimizer(model, SETTINGS)
    expected_metrics = [train_step(model, ref, optimizer, batch(seed), SETTINGS) for seed in (1, 2)]
    assert expected_metrics[0]["actor/micro_batches"] == 5

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name, want in model.state_dict().items():
        for got in ranks:
            torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    for got in ranks:
        for step_got, step_want in zip(got["metrics"], expected_metrics, strict=True):
            for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm",
                        "actor/action_tokens", "actor/tokens"):
                assert step_got[key] == pytest.approx(step_want[key], rel=1e-4, abs=1e-6), key
