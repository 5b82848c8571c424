"""Docker backend through the `docker` SDK: AgentBench's own mechanism, with limits added.

The image is `docker import`ed from the tarball that infra/sandbox/build-rootfs.sh leaves beside
the root filesystem (no registry). Each session is one container: no network, memory, pids and
CPU limits, removed at the end. The persistent shell is a `bash --login` exec, as AgentBench's
`Container` keeps one; scripts are separate execs (AgentBench's `exec_run`).

Disk: as in AgentBench, the whole root is writable (init scripts write to /, /usr, /etc), through
the container's own writable layer. overlay2 can bound that layer only on XFS with project quotas
(`--storage-opt size`), which these machines lack, so the layer's directory is put on a tmpfs of
`disk_bytes` between `create` and `start`: the overlay's upper and work dirs then live on it (the
bwrap backend's design), and `docker rm` unmounts it with the layer. That needs the engine on this
host (root, overlay2, its data root visible here). A remote or other engine gets a read-only root
with size-bounded tmpfs mounts where tasks commonly write (`TMPFS_PATHS`): init scripts that write
elsewhere fail there.

Containers carry their worker's host and pid (`OWNER_LABEL`); a new backend removes those of
workers on this host that died without ending their sessions (SIGKILL).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import struct
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker
import docker.errors

from env_workers.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxCrashed, ShellChannel, process_gone, rootfs_for
from env_workers.sandbox.bwrap import ENV, _kill, _mount, _umount, descendants
from env_workers.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)

LABEL = "rollstream.sandbox"
OWNER_LABEL = "rollstream.owner"
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


def owner() -> str:
    """This process, as the containers it starts name their owner (OWNER_LABEL): host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_gone(owner: str) -> bool:
    """Whether `host:pid` names a process of this host that has exited (another host's: not ours to judge)."""
    host, _, pid = owner.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and process_gone(int(pid))


def layer_boundable(info: dict[str, Any]) -> bool:
    """Whether the engine's writable layers can be put on a tmpfs from here: overlay2, this host, root."""
    root = Path(info.get("DockerRootDir") or "/nonexistent") / "overlay2"
    return (info.get("Driver") == "overlay2" and info.get("Name") == socket.gethostname()
            and os.geteuid() == 0 and root.is_dir())


def bound_layer(upper_dir: str, disk_bytes: int) -> Path:
    """Blocking: mounts a tmpfs of `disk_bytes` over the directory of a created, not yet started,
    container's writable layer, keeping what overlay2 put there (its lower-layer list, empty upper
    and work dirs); returns that directory."""
    layer = Path(upper_dir).parent
    staging = Path(tempfile.mkdtemp(prefix="rollstream-layer-"))
    try:
        shutil.copytree(layer, staging, symlinks=True, dirs_exist_ok=True)
        _mount("tmpfs", str(layer), "tmpfs", f"size={disk_bytes},mode=0710")
        shutil.copytree(staging, layer, symlinks=True, dirs_exist_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return layer


def _remove(container: Any, layer: Path | None) -> None:
    """Blocking: removes the container; the engine unmounts a bounded layer with it, else (engine gone) we do."""
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    finally:
        if layer is not None and os.path.ismount(layer):
            _umount(layer)


class DockerSandbox(Sandbox):
    backend = "docker"

    def __init__(self, client: docker.DockerClient, container: Any, layer: Path | None) -> None:
        super().__init__()
        self.client, self.container, self.layer = client, container, layer
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
        await asyncio.to_thread(_remove, self.container, self.layer)


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        try:
            self.client = (docker.DockerClient(base_url=settings.docker_host) if settings.docker_host
                           else docker.from_env())
            self.bounded_layer = layer_boundable(self.client.info())
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"no Docker engine: {error}") from error
        if not self.bounded_layer:
            log.warning("the Docker engine's writable layers cannot be bounded from here: read-only roots")
        self._image: str | None = None
        self._image_lock = asyncio.Lock()
        swept = self.sweep_orphans()
        if swept:
            log.warning("removed %d sandbox containers left behind by env workers that died", swept)

    def sweep_orphans(self) -> int:
        """Removes the containers of env workers of this host that died without ending their sessions."""
        swept = 0
        for container in self.client.containers.list(all=True, filters={"label": LABEL}):
            if _owner_gone(container.labels.get(OWNER_LABEL, "")):
                _remove(container, None)
                swept += 1
        return swept

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
        options: dict[str, Any] = dict(
            name=f"rollstream-os-{uuid.uuid4().hex[:12]}", labels={LABEL: "1", OWNER_LABEL: owner()},
            network_mode="none", mem_limit=s.memory_bytes, memswap_limit=s.memory_bytes, pids_limit=s.max_processes,
            nano_cpus=int(s.cpus * 1e9), working_dir="/", init=True,
            ulimits=[docker.types.Ulimit(name="fsize", soft=s.file_bytes, hard=s.file_bytes)],
        )
        if not self.bounded_layer:
            options.update(read_only=True, tmpfs={
                path: f"size={s.disk_bytes},mode={'1777' if 'tmp' in path else '0755'}" for path in TMPFS_PATHS})
        try:
            container = await asyncio.to_thread(self.client.containers.create, name, ["sleep", "infinity"], **options)
        except docker.errors.DockerException as error:
            raise SandboxCrashed(f"cannot create a container from {name}: {error}") from error
        layer = None
        try:
            if self.bounded_layer:
                layer = await asyncio.to_thread(bound_layer, container.attrs["GraphDriver"]["Data"]["UpperDir"],
                                                s.disk_bytes)
            await asyncio.to_thread(container.start)
        except (docker.errors.DockerException, OSError, KeyError) as error:
            await asyncio.to_thread(_remove, container, layer)
            raise SandboxCrashed(f"cannot start a container from {name}: {error}") from error
        return DockerSandbox(self.client, container, layer)

    async def aclose(self) -> None:
        self.client.close()
