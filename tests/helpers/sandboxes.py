"""The sandboxes' test fixtures: a private Docker engine, and a count of what sandboxes leave behind on this host."""

from __future__ import annotations

import glob
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from env_workers.sandbox import SandboxSettings
from env_workers.sandbox.docker_backend import LABEL
from pipeline.run.config import REPO_ROOT

DOCKER_HOST = f"unix://{REPO_ROOT / '.run' / 'dockerd' / 'docker.sock'}"


@pytest.fixture(scope="session")
def dockerd() -> Iterator[str]:
    """A private Docker engine (infra/sandbox/dockerd.sh installs docker.io if missing); stopped afterwards
    only when this session started it."""
    script = REPO_ROOT / "infra" / "sandbox" / "dockerd.sh"
    was_running = subprocess.run([script, "status"], capture_output=True).returncode == 0
    subprocess.run([script, "start"], check=True)
    yield DOCKER_HOST
    if not was_running:
        subprocess.run([script, "stop"], check=True)


def leftovers(settings: SandboxSettings) -> dict[str, int]:
    """What sandboxes of `settings`' backend left on this host: containers and layer mounts (Docker), or
    processes of the sandbox uid, mounts and session folders (bubblewrap). All 0 once every session ended."""
    if settings.backend == "docker":
        client = docker.DockerClient(base_url=settings.docker_host)
        containers = client.containers.list(all=True, filters={"label": LABEL})
        client.close()
        # Bounded writable layers: a tmpfs over each container's layer directory.
        layers = sum(1 for line in Path("/proc/mounts").read_text().splitlines()
                     if line.startswith("tmpfs ") and "/overlay2/" in line)
        return {"containers": len(containers), "layer_mounts": layers}
    processes = subprocess.run(["ps", "-u", str(settings.uid_base), "-o", "pid="], capture_output=True, text=True)
    mounts = Path("/proc/mounts").read_text().count("rollstream-os-")
    return {"processes": len(processes.stdout.split()), "mounts": mounts,
            "temp_dirs": len(glob.glob("/tmp/rollstream-os-*"))}


def settled_leftovers(settings: SandboxSettings, within_s: float = 10.0) -> dict[str, int]:
    """`leftovers`, once all are 0 or `within_s` has passed. A sandbox's end is asynchronous where the code
    ended its own shell: bubblewrap's monitor exits on its child's status without reaping the namespace's
    init, which host pid 1 then reaps when it gets round to it (seconds on these machines)."""
    deadline = time.monotonic() + within_s
    while True:
        found = leftovers(settings)
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
