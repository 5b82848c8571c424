"""docker-compose.yml is valid and runs the processes `rollstream up` runs, one per service (checked with
Debian's docker-compose, installed by infra/setup.sh; `make compose-test` runs the stack itself)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.command_line import parse_rollstream

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
PROCESSES = {"engine-current", "engine-stale", "streams", "env-worker", "learner", "dispatcher"}
JOBS = {"infra-init", "policy", "report"}


def _compose_config(*files: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MINIO_ROOT_", "BASE_IMAGE"))} | env
    argv = ["docker-compose"] + [a for f in ("docker-compose.yml", *files) for a in ("-f", str(REPO_ROOT / f))]
    return subprocess.run([*argv, "config"], capture_output=True, text=True, cwd=REPO_ROOT, env=environment)


def _services(*files: str) -> dict:
    result = _compose_config(*files, MINIO_ROOT_PASSWORD="a-secret-of-the-test")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def test_compose_runs_one_service_per_process_of_the_run():
    services = _services()
    assert set(services) == {"kafka", "minio"} | JOBS | PROCESSES
    assert services["kafka"]["image"] == "apache/kafka:4.1.1"
    for name in JOBS | PROCESSES:
        assert services[name]["image"] == "rollstream:local-cpu"
        assert services[name]["environment"]["ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"
    for name in PROCESSES:
        command = services[name]["command"]
        assert command[:2] == ["process", "engine" if name.startswith("engine") else name]
        assert command[command.index("--config") + 1] == "configs/cpu.yaml"
        assert services[name]["restart"] == "on-failure"
        after = {"infra-init": {"condition": "service_completed_successfully"},
                 "policy": {"condition": "service_completed_successfully"}}
        if name == "learner":  # its first weight broadcast must find the engines serving
            after |= {"engine-current": {"condition": "service_healthy"}, "engine-stale": {"condition": "service_healthy"}}
        assert services[name]["depends_on"] == after


def test_every_service_command_is_accepted_by_the_real_rollstream_command_line():
    services = _services()
    for name in JOBS | PROCESSES:
        parse_rollstream(services[name]["command"])


def test_the_learner_broadcasts_to_both_engines_by_their_service_names():
    services = _services()
    _, params = parse_rollstream(services["learner"]["command"])
    assert params["engine_url"] == ["current=http://engine-current:8000", "stale=http://engine-stale:8000"]
    assert params["broadcast_host"] == "learner"
    for pool in ("current", "stale"):
        _, params = parse_rollstream(services[f"engine-{pool}"]["command"])
        assert (params["pool"], params["advertise_host"], params["port"]) == (pool, f"engine-{pool}", 8000)


def test_the_local_images_override_builds_every_image_from_the_debootstrap_base():
    services = _services("infra/compose/local-images.yml")
    assert services["kafka"]["build"]["dockerfile"] == "infra/compose/kafka.Dockerfile"
    assert services["minio"]["build"]["dockerfile"] == "infra/compose/minio-prebuilt.Dockerfile"
    for name in ("kafka", "minio"):
        assert services[name]["build"]["args"]["BASE_IMAGE"] == "rollstream-base:bookworm"
    for name in ("kafka", "minio", "learner"):
        assert services[name]["build"]["network"] == "host"


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
    assert services["learner"]["environment"]["ROLLSTREAM_OBJECT_STORE__SECRET_KEY"] == "a-secret-of-the-test"


def test_the_gpu_override_gives_the_engines_and_the_learner_a_gpu_each_from_the_cuda_image():
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MINIO_ROOT_", "BASE_IMAGE"))}
    result = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f", "infra/compose/gpu.yml", "config"],
                            capture_output=True, text=True, cwd=REPO_ROOT,
                            env=environment | {"MINIO_ROOT_PASSWORD": "s", "ROLLSTREAM_EXTRA": "gpu"})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("engine-current", "engine-stale", "learner"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["count"]) == ("nvidia", 1)
    assert services["learner"]["build"]["args"]["EXTRA"] == "gpu"
    assert services["streams"]["image"] == "rollstream:local-gpu"
    assert "deploy" not in services["streams"]
