"""The engines of one host bind to disjoint cores, not all to vLLM's default ones."""

from __future__ import annotations

import pytest

from pipeline.engine.cpus import engine_cpu_sets, valid_binding


def test_a_single_engine_keeps_vllm_s_own_binding():
    assert engine_cpu_sets([0, 1], 1) == ["auto"]
    assert engine_cpu_sets([0, 1], 0) == []


def test_two_engines_on_two_cores_get_one_core_each():
    assert engine_cpu_sets([0, 1], 2) == ["0", "1"]


def test_cores_are_split_into_disjoint_near_equal_sets_of_the_allowed_cores():
    assert engine_cpu_sets([4, 5, 6, 7, 8], 2) == ["4,5", "6,7,8"]
    assert engine_cpu_sets(range(8), 3) == ["0,1", "2,3,4", "5,6,7"]


def test_more_engines_than_cores_share_the_cores_round_robin():
    assert engine_cpu_sets([0, 1], 3) == ["0", "1", "0"]


@pytest.mark.parametrize("value", ["auto", "nobind", "0", "0-3", "0,2-3,7"])
def test_vllm_s_binding_forms_are_accepted(value):
    assert valid_binding(value) == value


@pytest.mark.parametrize("value", ["", "all", "0-", "1;2", "0|1"])
def test_anything_else_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match="none of auto, nobind or a list of CPU ids"):
        valid_binding(value)


def test_an_engine_s_binding_reaches_its_vllm_server_and_auto_leaves_the_environment_s_own():
    from pathlib import Path

    from pipeline.engine.supervisor import EngineJob, EngineSettings, server_environment

    job = EngineJob(model=Path("m"), run="r", engine_id="e")
    bound = server_environment({"VLLM_CPU_OMP_THREADS_BIND": "0-7"}, EngineSettings(cpus="1"), job, None)
    assert bound["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_environment({}, EngineSettings(), job, None)
    assert server_environment({"VLLM_CPU_OMP_THREADS_BIND": "0-7"}, EngineSettings(), job, None)[
        "VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


def test_an_engine_setting_that_vllm_would_not_accept_is_refused():
    from pydantic import ValidationError

    from pipeline.engine.supervisor import EngineSettings

    with pytest.raises(ValidationError, match="none of auto, nobind"):
        EngineSettings(cpus="everything")
