"""The vLLM server's environment: what the engine settings put there."""

from pathlib import Path

from pipeline.engine.poll import POLL_SLEEP_ENV
from pipeline.engine.supervisor import (CPU_POLL_SLEEP_S, KEEP_FREED_MEMORY, EngineJob, EngineSettings,
                                       server_environment)

JOB = EngineJob(model=Path("m"), run="r", engine_id="e")


def test_the_server_keeps_freed_memory_for_the_next_weight_update_by_default():
    assert server_environment({}, EngineSettings(), JOB, None)["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY
    assert server_environment({"GLIBC_TUNABLES": "x=1"}, EngineSettings(), JOB, None)["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY


def test_empty_glibc_tunables_leave_the_environment_as_it_is():
    assert "GLIBC_TUNABLES" not in server_environment({}, EngineSettings(glibc_tunables=""), JOB, None)
    inherited = server_environment({"GLIBC_TUNABLES": "x=1"}, EngineSettings(glibc_tunables=""), JOB, None)
    assert inherited["GLIBC_TUNABLES"] == "x=1"


def test_a_cpu_engine_sleeps_between_polls_and_a_gpu_engine_keeps_vllms_loop_by_default():
    assert server_environment({}, EngineSettings(), JOB, None)[POLL_SLEEP_ENV] == repr(CPU_POLL_SLEEP_S)
    assert server_environment({}, EngineSettings(), JOB, None, on_gpu=True)[POLL_SLEEP_ENV] == "0.0"


def test_the_poll_sleep_setting_wins_over_the_default_and_over_an_inherited_value():
    inherited = {POLL_SLEEP_ENV: "0.5"}
    assert server_environment(inherited, EngineSettings(poll_sleep_s=0.001), JOB, None)[POLL_SLEEP_ENV] == "0.001"
    spinning = server_environment(inherited, EngineSettings(poll_sleep_s=0), JOB, None, on_gpu=True)
    assert spinning[POLL_SLEEP_ENV] == "0.0"
