"""Hostile commands and concurrency in the OS sandboxes, on both backends, through the env API."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers.sandboxes import dockerd, leftovers  # noqa: F401  (dockerd is a fixture)

from env_workers.envs.base import EnvSettings, Status, assistant_call
from env_workers.envs.os_env import OsEnvironment, make
from env_workers.sandbox import SandboxSettings
from env_workers.sandbox.bwrap import BwrapBackend
from env_workers.sandbox.docker_backend import DockerBackend

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"command_timeout_s": 3.0, "disk_bytes": 64 * 1024 * 1024, "max_processes": 64}

pytestmark = pytest.mark.integration


@pytest.fixture(params=["bwrap", "docker"])
def settings(request: pytest.FixtureRequest) -> SandboxSettings:
    if request.param == "docker":
        return SandboxSettings(backend="docker", docker_host=request.getfixturevalue("dockerd"), **LIMITS)
    return SandboxSettings(backend="bwrap", **LIMITS)


def _sample() -> dict:
    return {"id": "hostile", "description": "say ok", "image": "default", "init": [], "start": None,
            "match": {"answer": "ok", "strip": True}, "check": None, "example": None, "labels": []}


async def _episode(env: OsEnvironment, commands: list[str]) -> tuple[list[str], Status]:
    """Runs the commands, then answers "ok"; returns the tool outputs and the final status."""
    session = await env.start(_sample())
    outputs = []
    try:
        for command in commands:
            observation = await env.observation(session, assistant_call("bash_action", {"script": command}))
            if observation.finish:  # the sandbox died under the command: a task_error, cleaned up
                return outputs, observation.status
            outputs.append(observation.messages[0]["content"])
        final = await env.observation(session, assistant_call("answer_action", {"answer": "ok"}))
        return outputs, final.status
    finally:
        await env.end(session)


def _run(settings: SandboxSettings, commands: list[str]) -> tuple[list[str], Status]:
    return asyncio.run(_episode(make(EnvSettings(), settings), commands))


def test_sandbox_cannot_reach_a_port_open_on_host_loopback(settings: SandboxSettings) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        [output], status = _run(settings, [f"curl -s -m 2 http://127.0.0.1:{port}/; echo exit=$?"])
        with pytest.raises(BlockingIOError):
            server.accept()
    assert "exit=0" not in output and status == Status.COMPLETED


def test_sandbox_neither_reads_nor_writes_host_files(settings: SandboxSettings, tmp_path: Path) -> None:
    secret = Path("/tmp") / f"rollstream-secret-{uuid.uuid4().hex}"
    secret.write_text("s3cret-value")
    planted = Path("/tmp") / f"rollstream-planted-{uuid.uuid4().hex}"
    try:
        outputs, status = _run(settings, [f"cat {secret}; cat /etc/hostname", f"echo pwned > {planted}; ls /work"])
        assert "s3cret-value" not in outputs[0]
        assert not planted.exists() and status == Status.COMPLETED
    finally:
        secret.unlink()


def test_fork_bomb_is_contained_and_cleaned_up(settings: SandboxSettings) -> None:
    outputs, status = _run(settings, [":(){ :|:& };:", "echo alive"])
    assert status == Status.COMPLETED
    assert subprocess.run(["true"]).returncode == 0
    assert all(count == 0 for count in leftovers(settings).values())


def test_filling_the_disk_hits_the_sandbox_limit(settings: SandboxSettings) -> None:
    before = os.statvfs("/").f_bavail
    [output], status = _run(settings, ["dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1 | grep -o 'No space left\\|File too large'"])
    assert "No space left" in output or "File too large" in output
    assert status == Status.COMPLETED
    assert before - os.statvfs("/").f_bavail < 50 * 1024 * 1024 // os.statvfs("/").f_frsize


def test_writes_anywhere_in_the_root_share_the_disk_limit(settings: SandboxSettings) -> None:
    # AgentBench's init scripts write to /, /usr and /etc: the whole root is writable, and bounded.
    outputs, status = _run(settings, [
        "echo a > /stock.log && echo b > /usr/stock.log && echo c > /etc/stock.conf && cat /usr/stock.log",
        "dd if=/dev/zero of=/usr/fill bs=1M count=200 2>&1 | grep -o 'No space left\\|File too large'",
    ])
    assert outputs[0].strip() == "b" and "No space left" in outputs[1] and status == Status.COMPLETED
    assert all(count == 0 for count in leftovers(settings).values())


def test_endless_sleep_is_killed_at_the_command_timeout(settings: SandboxSettings) -> None:
    outputs, status = _run(settings, ["sleep infinity", "echo still-here"])
    assert "was killed" in outputs[0] and "still-here" in outputs[1] and status == Status.COMPLETED


def test_kill_all_and_rm_rf_root_leave_the_host_intact(settings: SandboxSettings) -> None:
    outputs, status = _run(settings, ["kill -9 -1", "echo back", "rm -rf --no-preserve-root / 2>/dev/null; echo done"])
    # bwrap: `kill -9 -1` spares its caller, the shell, and the namespace's init. Docker: it also
    # kills the container's main process, so the container stops and the session is a task_error.
    assert (status == Status.COMPLETED and "back" in outputs[1]) or status == Status.TASK_ERROR
    assert status == Status.COMPLETED or settings.backend == "docker"
    assert Path("/usr/bin/bash").exists() and (REPO_ROOT / "pyproject.toml").exists()
    assert all(count == 0 for count in leftovers(settings).values())


def test_32_concurrent_sessions_leave_nothing_behind(settings: SandboxSettings) -> None:
    async def many() -> list[tuple[list[str], Status]]:
        env = make(EnvSettings(), settings)
        return await asyncio.gather(*(_episode(env, [f"echo session-{i}"]) for i in range(32)))

    results = asyncio.run(many())
    assert [outputs[0].strip() for outputs, _ in results] == [f"session-{i}" for i in range(32)]
    assert {status for _, status in results} == {Status.COMPLETED}
    assert all(count == 0 for count in leftovers(settings).values()), json.dumps(leftovers(settings))


def test_sessions_of_a_sigkilled_worker_are_swept_by_the_next_backend() -> None:
    """A worker killed with SIGKILL leaves its sessions mounted; the next bwrap backend unmounts them."""
    settings = SandboxSettings(backend="bwrap", **LIMITS)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import asyncio, sys, time\n"
         "from env_workers.sandbox import SandboxSettings\n"
         "from env_workers.sandbox.bwrap import BwrapBackend\n"
         f"settings = SandboxSettings(backend='bwrap', **{LIMITS!r})\n"
         "sandboxes = [asyncio.run(BwrapBackend(settings).open('default')) for _ in range(2)]\n"
         "print('open', flush=True)\n"
         "time.sleep(600)\n"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert leftovers(settings)["temp_dirs"] == 2 and leftovers(settings)["mounts"] > 0
    finally:
        holder.kill()
        holder.wait()
    assert leftovers(settings)["temp_dirs"] == 2  # nobody cleaned up after the SIGKILL
    BwrapBackend(settings)
    assert all(count == 0 for count in leftovers(settings).values()), json.dumps(leftovers(settings))
    assert not list(Path("/sys/fs/cgroup").glob(f"rollstream-{holder.pid}-*"))


def test_containers_of_a_sigkilled_worker_are_removed_by_the_next_docker_backend(dockerd: str) -> None:
    settings = SandboxSettings(backend="docker", docker_host=dockerd, **LIMITS)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import asyncio, time\n"
         "from env_workers.sandbox import SandboxSettings\n"
         "from env_workers.sandbox.docker_backend import DockerBackend\n"
         f"settings = SandboxSettings(backend='docker', docker_host={dockerd!r}, **{LIMITS!r})\n"
         "backend = DockerBackend(settings)\n"
         "sandboxes = [asyncio.run(backend.open('default')) for _ in range(2)]\n"
         "print('open', flush=True)\n"
         "time.sleep(600)\n"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
    finally:
        holder.kill()
        holder.wait()
    assert leftovers(settings)["containers"] == 2  # nobody cleaned up after the SIGKILL
    DockerBackend(settings).client.close()
    assert all(count == 0 for count in leftovers(settings).values()), json.dumps(leftovers(settings))
