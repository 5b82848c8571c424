"""The os family's sandbox settings travel with EnvSettings: registry, run configuration, worker settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.sandbox import SandboxSettings, bwrap
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.run.config import load_config

CONFIGURED = SandboxSettings(backend="bwrap", memory_bytes=1 << 28, max_processes=32, command_timeout_s=5.0)


def test_registry_builds_the_os_family_with_the_configured_sandbox() -> None:
    env = registry.environment("os", EnvSettings(os_sandbox=CONFIGURED, os_rounds=4))
    assert env.sandbox_settings == CONFIGURED  # type: ignore[attr-defined]
    assert env.max_rounds == 4


def test_sandbox_settings_survive_the_worker_settings_file_that_up_writes() -> None:
    settings = EnvWorkerSettings(env=EnvSettings(os_sandbox=CONFIGURED))
    assert EnvWorkerSettings.model_validate_json(settings.model_dump_json()).env.os_sandbox == CONFIGURED


def test_run_configuration_composes_env_settings_from_environment_variables(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLSTREAM_DATA", str(tmp_path))
    monkeypatch.setenv("ROLLSTREAM_ENVS__OS_SANDBOX__BACKEND", "docker")
    monkeypatch.setenv("ROLLSTREAM_ENVS__OS_SANDBOX__DISK_BYTES", "1000000")
    envs = load_config().envs
    assert envs.data_root == tmp_path
    assert envs.os_sandbox.backend == "docker" and envs.os_sandbox.disk_bytes == 1_000_000
    assert envs.os_sandbox.memory_bytes == SandboxSettings().memory_bytes


def test_open_file_limit_is_capped_at_the_hosts_hard_limit_only_without_the_capability(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap.resource, "getrlimit", lambda _: (1024, 20_000))
    monkeypatch.setattr(bwrap, "_has_capability", lambda _: False)
    assert bwrap.open_files_limit(1 << 20) == 20_000
    assert bwrap.open_files_limit(4096) == 4096
    monkeypatch.setattr(bwrap, "_has_capability", lambda _: True)
    assert bwrap.open_files_limit(1 << 20) == 1 << 20
