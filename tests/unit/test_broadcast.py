"""Bucket layout and bucketed broadcast over a real 2-process Gloo group."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.broadcast import backend_for, receive_buckets, send_buckets
from learner.manifest import specs_of
from schemas.weight_layout import BUCKET_ALIGNMENT, TensorSpec, plan_buckets

LARGEST = 4000  # bytes of the largest tensor below
BUCKET_SIZES = (1000, LARGEST, 1 << 20)  # smaller than, equal to, and far above the largest tensor


def named_tensors() -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd byte sizes, a scalar and an empty tensor, deterministic in every process."""
    g = torch.Generator().manual_seed(7)
    return {
        "norm.weight": torch.randn(33, generator=g).to(torch.bfloat16),  # 66 bytes: misaligns the next offset
        "embed.weight": torch.randn(50, 20, generator=g),  # 4000 bytes, the largest
        "layer.bias": torch.randn(20, generator=g),
        "step": torch.tensor(123456789012, dtype=torch.int64),  # 0-dim
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "proj.weight": torch.randn(30, 10, generator=g).to(torch.float16),
        "head.weight": torch.randn(40, 20, generator=g),  # 3200 bytes: crosses a 1000-byte bucket
        "rope.inv_freq": torch.randn(16, generator=g).double(),
    }


def spec(name: str, nbytes: int) -> TensorSpec:
    return TensorSpec(name=name, shape=(nbytes,), dtype="uint8")


def test_a_tensor_crossing_the_bucket_size_moves_to_the_next_bucket():
    buckets = plan_buckets([spec("a", 600), spec("b", 600), spec("c", 300)], 1000)
    assert [[s.spec.name for s in b.slots] for b in buckets] == [["a"], ["b", "c"]]


def test_a_tensor_larger_than_the_bucket_gets_its_own_bucket():
    buckets = plan_buckets([spec("a", 10), spec("big", 5000), spec("c", 10)], 1000)
    assert [[s.spec.name for s in b.slots] for b in buckets] == [["a"], ["big"], ["c"]]
    assert buckets[1].nbytes == 5000


@pytest.mark.parametrize("bucket_size", BUCKET_SIZES)
def test_layout_keeps_every_tensor_once_in_order_within_the_size(bucket_size):
    specs = specs_of(named_tensors())
    buckets = plan_buckets(specs, bucket_size)
    assert [s.spec for b in buckets for s in b.slots] == specs
    for bucket in buckets:
        assert bucket.nbytes <= bucket_size or len(bucket.slots) == 1
        end = 0
        for slot in bucket.slots:
            assert slot.offset % BUCKET_ALIGNMENT == 0 and slot.offset >= end
            end = slot.offset + slot.spec.nbytes
        assert end == bucket.nbytes


def test_layout_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([spec("a", 1), spec("a", 2)], 100)


def test_sender_refuses_tensors_that_differ_from_the_layout_before_communicating():
    tensors = named_tensors()
    buckets = plan_buckets(specs_of(tensors), 1000)
    wrong = dict(tensors, **{"layer.bias": torch.zeros(21)})
    with pytest.raises(ValueError, match="layer.bias"):
        send_buckets(wrong, buckets, src=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="missing"):
        send_buckets({k: v for k, v in tensors.items() if k != "step"}, buckets, src=0, device=torch.device("cpu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 sends the named tensors for each bucket size; rank 1 receives and saves what came."""
    device = torch.device("cpu")
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensors = named_tensors()
        for bucket_size in BUCKET_SIZES:
            buckets = plan_buckets(specs_of(tensors), bucket_size)
            if rank == 0:
                send_buckets(tensors, buckets, src=0, device=device)
            else:
                received = [(name, t.clone()) for name, t in receive_buckets(buckets, src=0, device=device)]
                torch.save(received, Path(out_dir) / f"received_{bucket_size}.pt")
    finally:
        dist.destroy_process_group()


def test_broadcast_over_gloo_delivers_every_tensor_bit_identical(tmp_path):
    mp.spawn(_broadcast_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    expected = named_tensors()
    for bucket_size in BUCKET_SIZES:
        received = torch.load(tmp_path / f"received_{bucket_size}.pt")
        assert [name for name, _ in received] == list(expected), bucket_size
        for name, tensor in received:
            want = expected[name]
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            # bit-identical: compare raw bytes, not values (NaN-safe, no tolerance)
            assert tensor.reshape(-1).view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist(), name
