"""Which floating-point format the engines serve and the learner computes in, on the hardware at hand.

`auto` (an option of `engines.dtype`, `learner.compute_dtype` and `model sft --compute-dtype`) picks bfloat16 on
a CPU whose instruction set multiplies bfloat16 natively (AMX-BF16 or AVX512-BF16: the `amx_bf16` /
`avx512_bf16` flags of /proc/cpuinfo) and float32 on any other CPU, where bfloat16 is emulated. On a GPU an
engine's `auto` is vLLM's own (the checkpoint's dtype, bfloat16 for float32 checkpoints) and the learner's is
float32: its bfloat16 step on a GPU was not measured here. Every default is float32 on a CPU (docs/BENCHMARKS.md,
"bench precision"): bfloat16 engines served 1.32x the tokens/s and shortened a rollout-bound run by 19% on this
project's two-core Xeons, but a re-rollout on them (after a crash or a rebalance) no longer repeats its
log-probs within the 1e-4 that `replay verify` and `bench faults` hold a re-rollout to, and the learner's step
gained nothing beside the engines.

The learner's bfloat16 is torch autocast: the matrix products run in bfloat16 while the weights, the
optimizer state, the log-softmax and the loss stay float32 (learner/loss.py next_token_logits casts
the logits), which is what mixed-precision training means in verl and TRL too.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Literal

Precision = Literal["auto", "float32", "bfloat16"]
"""A dtype setting: auto (by the hardware, above), or one of the two named."""

BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
"""/proc/cpuinfo flags of a CPU that multiplies bfloat16 in hardware (Intel Sapphire Rapids on, AMD Zen 4 on)."""


def bf16_native(flags: Iterable[str]) -> bool:
    """Whether a CPU with these instruction-set flags computes bfloat16 natively."""
    return not BF16_CPU_FLAGS.isdisjoint(flags)


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of the first processor listed in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86; arm64 says Features
            return frozenset(value.split())
    return frozenset()


@cache
def host_cpu_flags() -> frozenset[str]:
    """This host's CPU flags (empty where /proc/cpuinfo cannot be read: not Linux)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()


def cpu_dtype(setting: Precision, flags: Iterable[str]) -> Literal["float32", "bfloat16"]:
    """The dtype a CPU process uses for `setting` on a CPU with these flags."""
    if setting != "auto":
        return setting
    return "bfloat16" if bf16_native(flags) else "float32"


def engine_dtype(setting: Precision | None, *, on_gpu: bool, flags: Iterable[str]) -> str:
    """vLLM's --dtype for an engine: on a GPU `auto` is vLLM's own choice, on a CPU it is `cpu_dtype`'s. None (the
    engines' default) is float32 on a CPU, where a re-rollout must repeat its log-probs within replay verify's
    tolerance, and vLLM's own choice on a GPU."""
    if setting is None:
        return "auto" if on_gpu else "float32"
    if on_gpu:
        return setting
    return cpu_dtype(setting, flags)


def learner_dtype(setting: Precision, *, on_gpu: bool, flags: Iterable[str]) -> Literal["float32", "bfloat16"]:
    """The learner's autocast dtype: on a GPU `auto` is float32 (not measured here), on a CPU `cpu_dtype`'s."""
    if on_gpu and setting == "auto":
        return "float32"
    return cpu_dtype(setting, flags)
