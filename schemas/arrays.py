"""Token arrays inside events: little-endian packed bytes with a fixed dtype per field.

Why bytes and not Avro arrays: an 8k-token trajectory is 32 kB of int32 ids as bytes, against
about 2x that (and a per-element decode loop) as an Avro array of ints; numpy reads the bytes
without copying. The dtype of each field is stated in its schema doc and here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_IDS = np.dtype("<i4")   # input_ids, output_ids
LOSS_MASK = np.dtype("u1")    # loss_mask
LOGPROBS = np.dtype("<f4")    # rollout_logprobs, output_logprobs


def pack(values: Sequence[float] | Sequence[int] | np.ndarray, dtype: np.dtype) -> bytes:
    """Packs a sequence as little-endian bytes of `dtype`."""
    return np.asarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype) -> np.ndarray:
    """Reads packed bytes back; raises ValueError when the length is not a multiple of the item size."""
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(data, dtype=dtype)


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    return pack(ids, TOKEN_IDS)


def unpack_ids(data: bytes) -> np.ndarray:
    return unpack(data, TOKEN_IDS)


def pack_mask(mask: Sequence[int] | np.ndarray) -> bytes:
    return pack(mask, LOSS_MASK)


def unpack_mask(data: bytes) -> np.ndarray:
    return unpack(data, LOSS_MASK)


def pack_logprobs(logprobs: Sequence[float] | np.ndarray) -> bytes:
    return pack(logprobs, LOGPROBS)


def unpack_logprobs(data: bytes) -> np.ndarray:
    return unpack(data, LOGPROBS)
