"""Bucketed broadcast of named tensors over a torch.distributed process group.

The same code runs on Gloo (CPU tensors) and NCCL (CUDA tensors); `backend_for` picks the
backend from the device. Sender and receiver both hold the bucket layout, computed by
`schemas.weight_layout.plan_buckets` from the same tensor specs (the version's manifest), so only
raw bytes cross the wire: one collective call per bucket, no per-tensor metadata exchange.

Costs: the sender copies each tensor once into a bucket buffer on `device`, and packs the next
bucket while the previous one is on the wire (two buckets alive at a time, so the extra memory is
two buckets); the receiver posts the next bucket's receive before it hands out the tensors of the
current one, which are views into a fresh buffer per bucket, without a copy, so it can load them
while the next bucket arrives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from learner.manifest import dtype_name, torch_dtype
from schemas.weight_layout import Bucket


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, Gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def _check_matches_layout(tensors: Mapping[str, torch.Tensor], buckets: Sequence[Bucket]) -> None:
    expected = {slot.spec.name: slot.spec for bucket in buckets for slot in bucket.slots}
    missing, extra = expected.keys() - tensors.keys(), tensors.keys() - expected.keys()
    if missing or extra:
        raise ValueError(f"tensors differ from the layout: missing {sorted(missing)}, not in layout {sorted(extra)}")
    for name, spec in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"tensor {name}: {tuple(tensor.shape)} {tensor.dtype}, layout says {spec.shape} {spec.dtype}"
            )


def send_buckets(
    tensors: Mapping[str, torch.Tensor],
    buckets: Sequence[Bucket],
    *,
    src: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Broadcasts every tensor of the layout from rank `src` (global rank); returns bytes sent.

    Checks first, before any collective call, that the tensors are exactly the layout's (names,
    shapes, dtypes), so a mismatch fails here instead of hanging the receivers.
    """
    _check_matches_layout(tensors, buckets)
    sent = 0
    in_flight: dist.Work | None = None
    with torch.no_grad():
        for bucket in buckets:
            if bucket.nbytes == 0:
                continue  # only empty tensors: the receiver knows them from the layout alone
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)  # (nbytes,)
            for slot in bucket.slots:  # packed while the previous bucket is on the wire
                raw = tensors[slot.spec.name].detach().reshape(-1).view(torch.uint8)  # (numel * itemsize,)
                buffer[slot.offset : slot.offset + slot.spec.nbytes].copy_(raw)
            if in_flight is not None:
                in_flight.wait()
            in_flight = dist.broadcast(buffer, src=src, group=group, async_op=True)
            sent += bucket.nbytes
        if in_flight is not None:
            in_flight.wait()
    return sent


def receive_buckets(
    buckets: Sequence[Bucket],
    *,
    src: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receives the layout's buckets from rank `src` and yields (name, tensor) in layout order.

    The tensors are views into their bucket's buffer (a new buffer per bucket): valid for as long
    as the caller keeps them, with no copy made here.
    """

    def post(bucket: Bucket) -> tuple[torch.Tensor, dist.Work | None]:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)  # (nbytes,)
        return buffer, dist.broadcast(buffer, src=src, group=group, async_op=True) if bucket.nbytes else None

    ahead = post(buckets[0]) if buckets else None
    for i, bucket in enumerate(buckets):
        buffer, arriving = ahead
        if arriving is not None:
            arriving.wait()
        # The next bucket travels while the caller loads this one's tensors.
        ahead = post(buckets[i + 1]) if i + 1 < len(buckets) else None
        for slot in bucket.slots:
            raw = buffer[slot.offset : slot.offset + slot.spec.nbytes]  # (nbytes,), offset aligned
            # uint8 -> dtype view needs an offset aligned to the item size: BUCKET_ALIGNMENT ensures it.
            yield slot.spec.name, raw.view(torch_dtype(slot.spec.dtype)).reshape(slot.spec.shape)
