"""GPU checks of the learner, run by hand on a CUDA machine (no GPU in CI): `python tests/gpu/check_cuda.py OUT.json [CHECK ...]`.

1. One learner step (learner.step.train_step, the real loss) on CUDA equals the same step on the CPU
   within float32 tolerance (TF32 off), from the same weights and batch.
2. Learner step throughput on the GPU for a Qwen2.5-0.5B-shaped model (random weights, bf16), tokens/s.
3. The fast path's collective on NCCL: learner.broadcast.send_buckets / receive_buckets between two
   processes; with one GPU both ranks share it, which NCCL may refuse (recorded, not hidden).
Needs torch, transformers, numpy, safetensors and pydantic; no Kafka, MinIO or vLLM.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from learner.broadcast import receive_buckets, send_buckets  # noqa: E402
from learner.manifest import specs_of  # noqa: E402
from learner.settings import LearnerSettings  # noqa: E402
from learner.step import make_optimizer, train_step  # noqa: E402
from schemas.weight_layout import plan_buckets  # noqa: E402


def tiny_config(vocab: int = 263) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def batch(vocab: int, items: int, length: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(items):
        n = int(length * (0.5 + 0.5 * rng.random()))
        ids = rng.integers(0, vocab, n).astype(np.int64)
        mask = np.zeros(n, dtype=np.int64)
        mask[n // 2:] = 1
        logprobs = np.where(mask == 1, -rng.random(n) * 3 - 2, 0).astype(np.float32)
        out.append((ids, mask, logprobs, float(rng.normal())))
    return out


def step_on(device: str, config: Qwen2Config, items: list, settings: LearnerSettings, dtype=torch.float32):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device=device)
    ref = copy.deepcopy(model).eval()
    optimizer = make_optimizer(model, settings)
    metrics = train_step(model, ref, optimizer, items, settings)
    return model, metrics


def check_equal_step() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config, settings = tiny_config(), LearnerSettings(lr=1e-3)
    items = batch(config.vocab_size, 8, 256, seed=1)
    cpu_model, cpu_metrics = step_on("cpu", config, items, settings)
    gpu_model, gpu_metrics = step_on("cuda", config, items, settings)
    worst = max(float((a.detach().cpu() - b.detach().cpu()).abs().max())
                for a, b in zip(cpu_model.parameters(), gpu_model.parameters()))
    keys = [k for k in cpu_metrics if isinstance(cpu_metrics[k], float) and "time" not in k and not k.endswith("_s")]
    diffs = {k: abs(cpu_metrics[k] - gpu_metrics[k]) for k in keys}
    return {"max_param_diff_after_step": worst, "metric_diffs": diffs,
            "equal": worst < 1e-4 and all(d < 1e-3 * max(1.0, abs(cpu_metrics[k])) for k, d in diffs.items())}


def throughput() -> dict:
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    # 8k tokens per micro-batch: 32k ran out of the H200's memory (fp32 log-softmax over 152k logits).
    settings = LearnerSettings(max_tokens_per_micro_batch=8192)
    items = batch(config.vocab_size, 64, 2048, seed=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype=torch.bfloat16, device="cuda")
    ref = copy.deepcopy(model).eval()
    optimizer = make_optimizer(model, settings)
    train_step(model, ref, optimizer, items[:8], settings)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    metrics = train_step(model, ref, optimizer, items, settings)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens = sum(len(i[0]) for i in items)
    return {"model": "Qwen2.5-0.5B shape, bf16", "parameters": sum(p.numel() for p in model.parameters()),
            "tokens": tokens, "step_s": elapsed, "tokens_per_s": tokens / elapsed,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}


def _rank(rank: int, port: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda:0"))
        torch.manual_seed(0)
        tensors = dict(sorted(Qwen2ForCausalLM(tiny_config()).state_dict().items()))
        tensors = {k: v.to("cuda") for k, v in tensors.items()}
        buckets = plan_buckets(specs_of(tensors), 64 * 1024)
        if rank == 0:
            sent = send_buckets(tensors, buckets, src=0, device=torch.device("cuda"))
            out = {"sent_bytes": sent, "buckets": len(buckets)}
        else:
            got = dict(receive_buckets(buckets, src=0, device=torch.device("cuda")))
            out = {"equal": all(torch.equal(got[k], tensors[k]) for k in tensors), "tensors": len(got)}
        dist.destroy_process_group()
    except Exception as error:  # recorded: NCCL may refuse two ranks on one GPU
        out = {"error": repr(error)[:500]}
    Path(f"{result_path}.{rank}").write_text(json.dumps(out))


def nccl_broadcast(tmp: Path) -> dict:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 29517, str(tmp / "nccl"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return {f"rank{r}": json.loads((tmp / f"nccl.{r}").read_text()) if (tmp / f"nccl.{r}").exists() else "no result"
            for r in range(2)}


def main() -> None:
    out, only = Path(sys.argv[1]), set(sys.argv[2:])
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, check in [("equal_step", check_equal_step), ("throughput", throughput),
                        ("nccl_broadcast", lambda: nccl_broadcast(out.parent))]:
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-1500:]}
        report[name + "_wall_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(report, indent=1))
        print(name, json.dumps(report[name])[:800], flush=True)


if __name__ == "__main__":
    main()
