"""Which dtype `auto` picks (schemas/precision.py) and the figures of bench precision (pipeline/bench/precision_logic.py)."""

from __future__ import annotations

import math

import pytest

from pipeline.bench.precision_logic import agreement, rate, speedup
from schemas.precision import cpu_dtype, cpu_flags, engine_dtype, learner_dtype

SAPPHIRE_RAPIDS = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
SKYLAKE = {"avx2", "avx512f"}


def test_cpu_flags_are_read_from_the_first_processor_of_cpuinfo():
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert cpu_flags("") == frozenset()


def test_auto_is_bfloat16_only_on_a_cpu_that_computes_it_natively():
    assert cpu_dtype("auto", SAPPHIRE_RAPIDS) == "bfloat16"
    assert cpu_dtype("auto", {"avx512_bf16"}) == "bfloat16"
    assert cpu_dtype("auto", SKYLAKE) == "float32"
    assert cpu_dtype("float32", SAPPHIRE_RAPIDS) == "float32"
    assert cpu_dtype("bfloat16", SKYLAKE) == "bfloat16"  # asked for by name: emulated, but given


def test_an_engine_serves_float32_on_a_cpu_and_vllms_choice_on_a_gpu_unless_told_otherwise():
    assert engine_dtype(None, on_gpu=False, flags=SAPPHIRE_RAPIDS) == "float32"
    assert engine_dtype(None, on_gpu=True, flags=SKYLAKE) == "auto"


def test_a_gpu_engine_leaves_auto_to_vllm_and_a_gpu_learner_keeps_float32():
    assert engine_dtype("auto", on_gpu=True, flags=SKYLAKE) == "auto"
    assert engine_dtype("bfloat16", on_gpu=True, flags=SKYLAKE) == "bfloat16"
    assert engine_dtype("auto", on_gpu=False, flags=SAPPHIRE_RAPIDS) == "bfloat16"
    assert learner_dtype("auto", on_gpu=True, flags=SAPPHIRE_RAPIDS) == "float32"
    assert learner_dtype("bfloat16", on_gpu=True, flags=SKYLAKE) == "bfloat16"
    assert learner_dtype("auto", on_gpu=False, flags=SKYLAKE) == "float32"


def test_agreement_measures_the_learner_against_the_engine_token_by_token():
    engine = [[-1.0, -2.0], [-0.5]]
    learner = [[-1.0, -2.0 + math.log(1.5)], [-0.5 - 0.01]]
    a = agreement(engine, learner, clip_low=0.2, clip_high=0.28)
    assert a["tokens"] == 3
    assert a["max_abs"] == pytest.approx(math.log(1.5))
    assert a["mean_abs"] == pytest.approx((math.log(1.5) + 0.01) / 3)
    assert a["mean"] == pytest.approx((math.log(1.5) - 0.01) / 3)
    assert a["outside_clip"] == pytest.approx(1 / 3)  # ratio 1.5 > 1.28; 0.99 is inside [0.8, 1.28]


def test_agreement_refuses_sequences_that_do_not_pair_up():
    with pytest.raises(ValueError, match="sequence 0"):
        agreement([[-1.0, -1.0]], [[-1.0]], 0.2, 0.2)
    with pytest.raises(ValueError, match="2 engine sequences"):
        agreement([[-1.0], [-1.0]], [[-1.0]], 0.2, 0.2)
    with pytest.raises(ValueError, match="no tokens"):
        agreement([[]], [[]], 0.2, 0.2)


def test_speedup_is_bfloat16_tokens_per_second_over_float32():
    rates = {"float32": rate(100, 2.0), "bfloat16": rate(100, 1.0)}
    assert rates["float32"]["tokens_per_s"] == 50.0
    assert speedup(rates) == 2.0
    with pytest.raises(ValueError, match="positive seconds"):
        rate(1, 0.0)
