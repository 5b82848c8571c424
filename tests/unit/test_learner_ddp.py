"""Two Gloo ranks, with DDP or with FSDP2, take the same step as one process on the same batch."""

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
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.distributed import Leader, agree_to_start, follow, parallelize, sync_from_leader
from learner.microbatch import rank_share
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step

# A budget that makes 5 micro-batches of the batch below: uneven over 2 ranks, so one rank pads.
# Shared prompts apply to one process only; the single-process step compared with the ranks' runs every row whole too.
SETTINGS = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=40, share_prompts=False)
CASES = {"ddp": ("ddp", False), "fsdp": ("fsdp", False), "fsdp-resumed": ("fsdp", True)}


def tiny_model() -> Qwen2ForCausalLM:
    """lm_head tied to the embedding, as the default policy's: under FSDP both sit in the root group."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=128,
                         tie_word_embeddings=True)
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


def _train(rank: int, settings: LearnerSettings, resumed: bool, out: Path) -> None:
    """Two steps on 2 ranks (the first one before parallelizing, as a resumed checkpoint's optimizer
    state would be, when `resumed`); rank 0 saves what it would publish and checkpoint."""
    model = tiny_model()
    if rank == 1:  # a rank that starts from different weights is brought in line by rank 0
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    ref = copy.deepcopy(model)
    optimizer = make_optimizer(model, settings)
    sync_from_leader(model, optimizer)
    ref.load_state_dict(model.state_dict())
    metrics = [train_step(model, ref, optimizer, batch(1), settings)] if resumed else []
    parallel = parallelize(model, optimizer, settings)  # carries AdamW's moments over to the shards
    seeds = (2,) if resumed else (1, 2)
    if rank != 0:
        assert follow(model, parallel, ref, settings) == len(seeds)
        return
    leader = Leader(model, parallel, ref, settings)
    metrics += [leader.step(batch(seed)) for seed in seeds]  # the second step uses AdamW's moments
    torch.save({"state": leader.weights(), "optimizer": leader.optimizer_state(), "metrics": metrics}, out)
    leader.stop()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0's start-up verdict reaches every rank (here: it started)
        assert agree_to_start(None if rank == 0 else "ignored: only rank 0's counts") is None
        for case, (parallelism, resumed) in CASES.items():  # one process group for all: spawning costs more
            _train(rank, LearnerSettings(**{**SETTINGS.model_dump(), "parallelism": parallelism}), resumed,
                   Path(out) / f"{case}.pt")
        # Neither rank tears Gloo down while the other may still be in a collective (a clean-clone CI
        # run once ended rank 0 with SIGABRT, "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_rank_trains_its_round_robin_share_and_pads_to_equal_passes():
    assert rank_share(5, 2, 0) == [(0, 1.0), (2, 1.0), (4, 1.0)]
    assert rank_share(5, 2, 1) == [(1, 1.0), (3, 1.0), (1, 0.0)]
    assert rank_share(1, 2, 1) == [(0, 0.0)]
    assert rank_share(3, 1, 0) == [(0, 1.0), (1, 1.0), (2, 1.0)]


def test_two_gloo_ranks_with_ddp_or_fsdp_equal_a_single_process_step(tmp_path):
    """FSDP also from an optimizer with state, as after a resume: its moments are sharded too."""
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)

    model = tiny_model()
    ref = copy.deepcopy(model)
    optimizer = make_optimizer(model, SETTINGS)
    expected_metrics = [train_step(model, ref, optimizer, batch(seed), SETTINGS) for seed in (1, 2)]
    assert expected_metrics[0]["actor/micro_batches"] == 5
    for case in CASES:
        _check(torch.load(tmp_path / f"{case}.pt"), model, optimizer, expected_metrics)


def _check(got: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, expected_metrics: list) -> None:
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    # the optimizer state a checkpoint gets is the whole one, keyed by parameter name
    want_moments = dict(zip([n for n, _ in model.named_parameters()], optimizer.state.values(), strict=True))
    for name, moments in want_moments.items():
        torch.testing.assert_close(got["optimizer"]["state"][name]["exp_avg_sq"], moments["exp_avg_sq"],
                                   rtol=1e-4, atol=1e-9, msg=name)
    for step_got, step_want in zip(got["metrics"], expected_metrics, strict=True):
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm",
                    "actor/action_tokens", "actor/tokens"):
            assert step_got[key] == pytest.approx(step_want[key], rel=1e-4, abs=1e-6), key
