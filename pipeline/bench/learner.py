"""`rollstream bench learner`: what the learner step and weight publishing cost on this machine.

Each figure stands beside a baseline measured in the same run:
- learner tokens/s (learner/step.py's train_step: reference forward, actor forward/backward per
  micro-batch with the dual-clip PPO + KL loss and its diagnostics, clip, AdamW) against a bare
  torch loop over the same micro-batch tensors doing the same model work (reference forward under
  no_grad, actor forward/backward with a plain policy-gradient loss, clip, AdamW);
- publish to MinIO (safetensors shards, sha256, upload, manifest) against a memory copy and a
  local file write (fsync) of the same bytes, for the default policy's shape and, with --large,
  a ~0.5B random model (Qwen2.5-0.5B's shape; 2 GB of float32, slow on two cores).
The headline `ratio` is learner tokens/s / bare-loop tokens/s (goal >= 0.9: <= 10% overhead).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import typer
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.broadcast import receive_buckets, send_buckets
from learner.manifest import encode_version, specs_of
from learner.microbatch import BatchItem, make_micro_batches
from learner.publish import prune_versions, stage_version, tied_aliases, without_aliases
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.engine.launch import free_port
from pipeline.policy.model_init import ADDED_TOKENS, PolicyModelSettings, build_config, build_tokenizer
from pipeline.run.config import load_config
from schemas import objectstore, topics
from schemas.weight_layout import plan_buckets

MB = 1024 * 1024


def default_config() -> Qwen2Config:
    """The default policy's shape as `rollstream model init` builds it: its vocabulary is the default
    number of BPE tokens plus the added ones (learning the merges themselves would change no shape)."""
    config = build_config(PolicyModelSettings(), build_tokenizer())
    config.vocab_size = PolicyModelSettings().vocab_size + len(ADDED_TOKENS)
    return config


# Qwen2.5-0.5B's shape (494M parameters).
LARGE_SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
               "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}


def synthetic_batch(sequences: int, vocab: int, rng: np.random.Generator) -> list[BatchItem]:
    """Agent-like trajectories: a prompt, then action tokens with rollout log-probs and an advantage."""
    items = []
    for _ in range(sequences):
        n = int(rng.integers(128, 384))
        mask = np.zeros(n, dtype=np.uint8)
        mask[int(rng.integers(32, 96)):] = 1
        logprobs = (-rng.exponential(1.0, n) * mask).astype(np.float32)
        items.append((rng.integers(0, vocab, n).astype(np.int32), mask, logprobs, float(rng.normal())))
    return items


def bare_step(model, ref, optimizer, micro_batches, settings: LearnerSettings) -> None:
    """The same model work as train_step with nothing around it: the baseline."""
    with torch.no_grad():
        for mb in micro_batches:
            ref(input_ids=torch.from_numpy(mb.input_ids), attention_mask=torch.from_numpy(mb.attention_mask))
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(mb.action_tokens for mb in micro_batches)
    for mb in micro_batches:
        ids = torch.from_numpy(mb.input_ids)  # (B, T)
        logits = model(input_ids=ids, attention_mask=torch.from_numpy(mb.attention_mask)).logits[:, :-1]  # (B, T-1, V)
        logp = torch.log_softmax(logits / settings.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        loss = -(logp * torch.from_numpy(mb.advantages)).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    optimizer.step()


def step_throughput(sequences: int, repeats: int, settings: LearnerSettings) -> dict:
    torch.manual_seed(0)
    config = default_config()
    model = Qwen2ForCausalLM(config)
    ref = copy.deepcopy(model).requires_grad_(False)
    items = synthetic_batch(sequences, config.vocab_size, np.random.default_rng(0))
    micro_batches = make_micro_batches(items, settings.max_tokens_per_micro_batch)
    tokens = sum(int(mb.attention_mask.sum()) for mb in micro_batches)
    optimizer = make_optimizer(model, settings)
    learner_s, bare_s = [], []
    train_step(model, ref, optimizer, items, settings)  # warm-up (allocator, kernels)
    bare_step(model, ref, optimizer, micro_batches, settings)
    for _ in range(repeats):  # interleaved, so machine load drifts hit both alike
        t = time.perf_counter()
        train_step(model, ref, optimizer, items, settings)
        learner_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        bare_step(model, ref, optimizer, micro_batches, settings)
        bare_s.append(time.perf_counter() - t)
    learner, bare = tokens / min(learner_s), tokens / min(bare_s)
    return {"tokens": tokens, "micro_batches": len(micro_batches), "learner_tokens_per_s": learner,
            "bare_tokens_per_s": bare, "ratio": learner / bare}


def random_tensors(model_config: Qwen2Config) -> dict[str, torch.Tensor]:
    """A random Qwen2 version of this shape as the learner publishes it (a tied tensor once),
    without the slow Hugging Face initialization."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config)
    g = torch.Generator().manual_seed(0)
    published = without_aliases(model.state_dict(), tied_aliases(model))
    return {name: torch.randn(t.shape, generator=g) * 0.02 for name, t in published.items()}


def _broadcast_receiver(port: int, specs: list, bucket_size_bytes: int) -> None:
    """Rank 1 of the broadcast measurement: receives every bucket, as an engine worker does."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    dist.barrier()  # matches the sender's: collectives must pair up in order
    for _ in receive_buckets(plan_buckets(specs, bucket_size_bytes), src=0, device=torch.device("cpu")):
        pass
    dist.barrier()
    dist.destroy_process_group()


def broadcast_seconds(tensors: dict[str, torch.Tensor], bucket_size_bytes: int) -> float:
    """Seconds to broadcast `tensors` in buckets to one receiving process over Gloo (the fast
    path's collective, without vLLM's load into the model)."""
    port = free_port()
    specs = specs_of(tensors)
    ctx = mp.get_context("spawn")
    receiver = ctx.Process(target=_broadcast_receiver, args=(port, specs, bucket_size_bytes))
    receiver.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    try:
        dist.barrier()  # both ranks up: time the transfer only
        started = time.perf_counter()
        send_buckets(tensors, plan_buckets(specs, bucket_size_bytes), src=0, device=torch.device("cpu"))
        dist.barrier()  # the receiver has every bucket
        return time.perf_counter() - started
    finally:
        dist.destroy_process_group()
        receiver.join(60)


def publish_times(cfg, label: str, model_config: Qwen2Config, settings: LearnerSettings) -> dict:
    tensors = random_tensors(model_config)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    t = time.perf_counter()
    copies = {name: tensor.clone() for name, tensor in tensors.items()}
    copy_s = time.perf_counter() - t
    del copies
    _, shards = encode_version(tensors, version=0, step=0, config=model_config.to_dict(), max_shard_bytes=settings.max_shard_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        for file, data in shards.items():
            with open(Path(tmp) / file, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        file_s = time.perf_counter() - t
    del shards
    mc = objectstore.client(cfg.object_store)
    run = f"bench-{uuid.uuid4().hex[:10]}"
    t = time.perf_counter()
    stage_version(mc, run, tensors, version=0, step=0, config=model_config.to_dict(), max_shard_bytes=settings.max_shard_bytes)
    publish_s = time.perf_counter() - t
    prune_versions(mc, run, keep=set())
    broadcast_s = broadcast_seconds(tensors, settings.bucket_size_bytes)
    return {"model": label, "parameters": sum(t.numel() for t in tensors.values()), "mb": nbytes / MB,
            "publish_s": publish_s, "publish_mb_per_s": nbytes / MB / publish_s,
            "broadcast_s": broadcast_s, "broadcast_mb_per_s": nbytes / MB / broadcast_s, "memory_copy_s": copy_s,
            "file_write_s": file_s, "ratio_to_file_write": file_s / publish_s}


def bench_learner(
    sequences: int = typer.Option(16, help="Trajectories in the synthetic batch (128-384 tokens each)."),
    repeats: int = typer.Option(3, help="Timed steps of each loop (the best is kept)."),
    large: bool = typer.Option(False, "--large", help="Also publish a ~0.5B random model (2 GB; minutes on 2 cores)."),
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Measures learner tokens/s against a bare torch loop, and weight publishing (to MinIO, and by
    bucketed Gloo broadcast to a receiving process) against memory-copy and file-write baselines
    of the same bytes.

    Example: rollstream bench learner --json
    """
    if sequences < 1 or repeats < 1:
        typer.echo("rollstream bench learner: --sequences and --repeats must be >= 1", err=True)
        raise typer.Exit(code=1)
    cfg = load_config(config)
    # Every row whole, as the bare loop runs them: the figure is the step's overhead over the same model work
    # (learner.share_prompts changes that work, by the prompts a batch's rows share).
    settings = LearnerSettings(max_tokens_per_micro_batch=4096, share_prompts=False)
    objectstore.ensure_buckets(objectstore.client(cfg.object_store), [topics.WEIGHTS_BUCKET])
    say = (lambda m: None) if not sys.stderr.isatty() else (lambda m: Console(stderr=True).print(m))
    say("learner step vs bare loop ...")
    step = step_throughput(sequences, repeats, settings)
    say("publishing ...")
    publishes = [publish_times(cfg, "default", default_config(), settings)]
    if large:
        publishes.append(publish_times(cfg, "0.5B", Qwen2Config(**LARGE_SHAPE), settings))
    result = {"ratio": step["ratio"], "step": step, "publish": publishes, "machine": {"cpus": os.cpu_count()}}
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title="rollstream bench learner")
    for col in ("measure", "rollstream path", "baseline (same run)", "ratio"):
        table.add_column(col)
    table.add_row(f"learner step, {step['tokens']} tokens", f"{step['learner_tokens_per_s']:.0f} tok/s",
                  f"bare torch loop {step['bare_tokens_per_s']:.0f} tok/s", f"{step['ratio']:.3f}")
    for p in publishes:
        table.add_row(f"publish {p['model']} ({p['mb']:.0f} MB) to MinIO", f"{p['publish_s']:.2f} s",
                      f"file write {p['file_write_s']:.2f} s, memory copy {p['memory_copy_s']:.3f} s",
                      f"{p['ratio_to_file_write']:.3f}")
        table.add_row(f"broadcast {p['model']} ({p['mb']:.0f} MB) over Gloo", f"{p['broadcast_s']:.2f} s",
                      f"memory copy {p['memory_copy_s']:.3f} s", f"{p['memory_copy_s'] / p['broadcast_s']:.3f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(bench_learner)
