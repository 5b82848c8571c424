"""Test session set-up: the real Kafka broker and MinIO server, started once per session.

`make test` starts them before pytest (infra/with-infra.sh); when pytest is run by hand and they
are not up, the `infra` fixture starts them with the project's own scripts and stops them at the
end of the session. Nothing is mocked and nothing is skipped.

Every test under tests/integration carries the `integration` marker, whether or not its file says
so (a new file cannot forget it): `pytest -m "not integration"` and `pytest tests/unit` run
with no service at all.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.run.config import RollstreamConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
INTEGRATION = REPO_ROOT / "tests" / "integration"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test collected from tests/integration `integration`."""
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


def _running(script: str) -> bool:
    return subprocess.run([str(REPO_ROOT / "infra" / script), "status"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def infra() -> RollstreamConfig:
    """Kafka and MinIO, up, with every topic and bucket; the configuration that reaches them."""
    started = not (_running("kafka.sh") and _running("minio.sh"))
    subprocess.run([str(REPO_ROOT / "infra" / "up.sh")], check=True)
    yield load_config()
    if started:
        subprocess.run([str(REPO_ROOT / "infra" / "down.sh")], check=True)
