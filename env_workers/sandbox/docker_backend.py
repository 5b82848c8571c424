"""Docker backend through the `docker` SDK: AgentBench's own mechanism, with limits added.

The image is `docker import`ed from the tarball that infra/sandbox/build-rootfs.sh leaves beside
the root filesystem (no registry). Each session is one container: no network, memory, pids and
CPU limits, a read-only root with size-bounded tmpfs mounts for the places tasks write, removed
at the end. The persistent shell is a `bash --login` exec, as AgentBench's `Container` keeps one;
scripts are separate execs (AgentBench's `exec_run`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker
import docker.errors

from env_workers.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxCrashed, ShellChannel, rootfs_for
from env_workers.sandbox.bwrap import ENV, _kill, descendants
from env_workers.sandbox.settings import SandboxSettings

LABEL = "rollstream.sandbox"
TMPFS_PATHS = ("/tmp", "/root", "/home", "/run", "/var/tmp", "/opt", "/srv", "/mnt", "/media")


def docker_reachable(host: str | None) -> bool:
    try:
        client = docker.DockerClient(base_url=host, timeout=3) if host else docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except docker.errors.DockerException:
        return False


class _ExecShell(ShellChannel):
    """A `bash --login` exec; its stream is docker's multiplexed framing (8-byte headers)."""

    def __init__(self, api: Any, exec_id: str, sock: socket.socket) -> None:
        self.api, self.exec_id, self.sock = api, exec_id, sock
        self.sock.setblocking(False)
        self._buffer = b""
        self._closed = False

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def receive(self) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            payload, offset = bytearray(), 0
            while len(self._buffer) - offset >= 8:
                (size,) = struct.unpack(">L", self._buffer[offset + 4 : offset + 8])
                if len(self._buffer) - offset - 8 < size:
                    break
                payload += self._buffer[offset + 8 : offset + 8 + size]
                offset += 8 + size
            self._buffer = self._buffer[offset:]
            if payload:
                return bytes(payload)
            chunk = await loop.sock_recv(self.sock, 65536)
            if not chunk:
                return b""
            self._buffer += chunk

    def _pid(self) -> int:
        return int(self.api.exec_inspect(self.exec_id).get("Pid") or 0)

    async def interrupt(self) -> None:
        # The engine runs on this host (it was started by infra/sandbox/dockerd.sh): its exec pid is ours to see.
        pid = await asyncio.to_thread(self._pid)
        if pid:
            _kill(descendants(pid))

    async def kill(self) -> None:
        if self._closed:
            return
        self._closed = True
        pid = await asyncio.to_thread(self._pid)
        if pid:
            _kill([pid])
        self.sock.close()


class DockerSandbox(Sandbox):
    backend = "docker"

    def __init__(self, client: docker.DockerClient, container: Any) -> None:
        super().__init__()
        self.client, self.container = client, container
        self._released = False

    async def _open_shell(self) -> ShellChannel:
        def start() -> _ExecShell:
            exec_id = self.client.api.exec_create(
                # stderr joins stdout inside, so the two keep their order as in a terminal.
                self.container.id, ["bash", "-c", "exec bash --login 2>&1"], stdin=True, tty=False,
                environment=ENV, workdir="/",
            )["Id"]
            sock = self.client.api.exec_start(exec_id, socket=True)._sock
            return _ExecShell(self.client.api, exec_id, sock)

        try:
            return await asyncio.to_thread(start)
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"cannot start the container's shell: {error}") from error

    async def run(self, argv: Sequence[str], timeout_s: float) -> ExecResult:
        api = self.client.api
        try:
            exec_id = await asyncio.to_thread(
                lambda: api.exec_create(self.container.id, list(argv), environment=ENV, workdir="/")["Id"]
            )
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"cannot exec in the container: {error}") from error
        try:
            output = await asyncio.wait_for(asyncio.to_thread(api.exec_start, exec_id), timeout_s)
        except asyncio.TimeoutError:
            pid = int((await asyncio.to_thread(api.exec_inspect, exec_id)).get("Pid") or 0)
            if pid:
                _kill([pid, *descendants(pid)])
            return ExecResult(-1, "", timed_out=True)
        code = (await asyncio.to_thread(api.exec_inspect, exec_id)).get("ExitCode")
        return ExecResult(int(code if code is not None else -1), output.decode("utf-8", errors="replace"))

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            await asyncio.to_thread(self.container.remove, force=True)
        except docker.errors.NotFound:
            pass


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        try:
            self.client = (docker.DockerClient(base_url=settings.docker_host) if settings.docker_host
                           else docker.from_env())
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"no Docker engine: {error}") from error
        self._image: str | None = None
        self._image_lock = asyncio.Lock()

    async def image(self) -> str:
        """The imported root filesystem, tagged by its content hash (imported once per engine)."""
        async with self._image_lock:
            if self._image is None:
                rootfs = Path(await rootfs_for(str(self.settings.rootfs_script)))
                tag = rootfs.name.removeprefix("rootfs-")
                name = f"{self.settings.image_prefix}:{tag}"
                try:
                    await asyncio.to_thread(self.client.images.get, name)
                except docker.errors.ImageNotFound:
                    await asyncio.to_thread(
                        self.client.api.import_image_from_file, f"{rootfs}.tar",
                        repository=self.settings.image_prefix, tag=tag,
                    )
                self._image = name
        return self._image

    async def open(self, image: str) -> Sandbox:
        s = self.settings
        name = await self.image()
        tmpfs = {path: f"size={s.disk_bytes},mode={'1777' if 'tmp' in path else '0755'}" for path in TMPFS_PATHS}
        try:
            container = await asyncio.to_thread(
                self.client.containers.run, name, ["sleep", "infinity"], detach=True,
                name=f"rollstream-os-{uuid.uuid4().hex[:12]}", labels={LABEL: "1"}, network_mode="none",
                mem_limit=s.memory_bytes, memswap_limit=s.memory_bytes, pids_limit=s.max_processes,
                nano_cpus=int(s.cpus * 1e9), read_only=True, tmpfs=tmpfs, working_dir="/", init=True,
                ulimits=[docker.types.Ulimit(name="fsize", soft=s.file_bytes, hard=s.file_bytes)],
            )
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"cannot start a container from {name}: {error}") from error
        return DockerSandbox(self.client, container)

    async def aclose(self) -> None:
        self.client.close()
