"""docker-compose.yml is valid and runs the same stack (no Docker engine runs on these machines, so
the file is checked with Debian's docker-compose, installed by infra/setup.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def _compose_config(**env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MINIO_ROOT_")} | env
    return subprocess.run(["docker-compose", "-f", str(REPO_ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=environment)


def _services() -> dict:
    result = _compose_config(MINIO_ROOT_PASSWORD="a-secret-of-the-test")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def test_compose_file_validates_and_runs_the_make_run_configuration():
    services = _services()
    assert {"kafka", "minio", "infra-init", "trainer", "env-worker", "trainer-gpu"} <= set(services)
    assert services["kafka"]["image"] == "apache/kafka:4.1.1"
    for name in ("trainer", "env-worker"):
        assert services[name]["image"] == "rollstream:local"
        assert services[name]["environment"]["ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert services["trainer"]["command"][:3] == ["up", "--config", "configs/cpu.yaml"]
    assert services["trainer-gpu"]["command"] == services["trainer"]["command"]


def test_compose_env_workers_join_the_trainers_run_with_its_limits():
    services = _services()
    worker = services["env-worker"]["command"]
    options = dict(zip(worker[1::2], worker[2::2]))
    trainer = services["trainer"]["command"]
    assert options["--run"] == trainer[trainer.index("--run") + 1]
    assert options["--config"] == trainer[trainer.index("--config") + 1]  # the same envs settings, task for task
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "cpu.yaml").read_text())
    assert (int(options["--max-turns"]), int(options["--max-total-len"]), int(options["--max-new-tokens"]),
            int(options["--concurrency"])) == (cfg["agent_loop"]["max_turns"], cfg["agent_loop"]["max_total_len"],
                                               cfg["agent_loop"]["max_new_tokens"], cfg["env_workers"]["concurrency"])
    # engines bind every interface and announce the trainer's host name, where these workers find them
    env = services["trainer"]["environment"]
    assert (env["ROLLSTREAM_ENGINES__BIND_HOST"], env["ROLLSTREAM_ENGINES__ADVERTISE_HOST"]) == ("0.0.0.0", "trainer")
    assert services["trainer"]["hostname"] == "trainer"


def test_compose_builds_minio_at_the_version_the_local_scripts_pin():
    env = (REPO_ROOT / "infra" / "env.sh").read_text()
    pinned = env.split('MINIO_VERSION="${MINIO_VERSION:-', 1)[1].split("}", 1)[0]
    assert f"MINIO_VERSION={pinned}" in (REPO_ROOT / "infra" / "minio.Dockerfile").read_text()


def test_compose_refuses_to_start_without_a_minio_secret_of_the_users_own():
    result = _compose_config()
    assert result.returncode != 0
    assert "MINIO_ROOT_PASSWORD" in result.stderr
    services = _services()
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "a-secret-of-the-test"
    assert services["trainer"]["environment"]["ROLLSTREAM_OBJECT_STORE__SECRET_KEY"] == "a-secret-of-the-test"
