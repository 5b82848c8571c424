"""docker-compose.yml is valid and runs the same stack (no Docker engine runs on these machines, so
the file is checked with Debian's docker-compose, installed by infra/setup.sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_validates_and_names_every_process():
    result = subprocess.run(["docker-compose", "-f", str(REPO_ROOT / "docker-compose.yml"), "config"],
                            capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"kafka", "minio", "infra-init", "streams", "engine-current", "engine-stale", "env-worker",
            "learner", "dispatcher"} <= set(services)
    assert services["kafka"]["image"] == "apache/kafka:4.1.1"
    for name in ("streams", "env-worker", "learner", "dispatcher", "engine-current", "engine-stale"):
        assert services[name]["image"] == "rollstream:local"
        assert services[name]["environment"]["ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"


def test_compose_builds_minio_at_the_version_the_local_scripts_pin():
    env = (REPO_ROOT / "infra" / "env.sh").read_text()
    pinned = env.split('MINIO_VERSION="${MINIO_VERSION:-', 1)[1].split("}", 1)[0]
    assert f"MINIO_VERSION={pinned}" in (REPO_ROOT / "infra" / "minio.Dockerfile").read_text()
