"""The vLLM server's environment: what the engine settings put there."""

from pathlib import Path

from pipeline.engine.supervisor import KEEP_FREED_MEMORY, EngineJob, EngineSettings, server_environment

JOB = EngineJob(model=Path("m"), run="r", engine_id="e")


def test_the_server_keeps_freed_memory_for_the_next_weight_update_by_default():
    assert server_environment({}, EngineSettings(), JOB, None)["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY
    assert server_environment({"GLIBC_TUNABLES": "x=1"}, EngineSettings(), JOB, None)["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY


def test_empty_glibc_tunables_leave_the_environment_as_it_is():
    assert "GLIBC_TUNABLES" not in server_environment({}, EngineSettings(glibc_tunables=""), JOB, None)
    inherited = server_environment({"GLIBC_TUNABLES": "x=1"}, EngineSettings(glibc_tunables=""), JOB, None)
    assert inherited["GLIBC_TUNABLES"] == "x=1"
