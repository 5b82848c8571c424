"""What every sandbox backend offers the OS family: a persistent shell plus independent scripts.

AgentBench's OS task keeps one `bash --login` per episode (so `cd`, variables and background jobs
persist across turns) and runs init, example and check scripts as separate processes in the same
container (`exec_run`). `ShellSession` reproduces the first over any byte channel: each command is
sent base64-encoded to `eval` with stdin from /dev/null (so a command that reads stdin cannot eat
the next one), followed by a marker line carrying a per-session random token and the exit code.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

# Output kept in memory per command: `yes` alone writes gigabytes within a timeout.
OUTPUT_CAP_BYTES = 64 * 1024
# After a timeout the foreground processes are killed; the shell then has this long to report.
INTERRUPT_GRACE_S = 5.0
# How long a new shell may take to answer its first command.
STARTUP_TIMEOUT_S = 30.0
TRUNCATION_NOTE = "\n[truncated because the output is too long]"


class SandboxCrashed(Exception):
    """The sandbox itself failed (could not start, or its shell cannot be restarted)."""


@dataclass(frozen=True)
class ExecResult:
    """One command's combined stdout+stderr (as AgentBench's exec_run returns it) and exit code."""

    exit_code: int
    output: str
    timed_out: bool = False
    shell_restarted: bool = False


def process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has exited (one we may not signal is alive: not ours to judge).
    Both backends name what a worker leaves behind after its pid, and sweep what dead workers left."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def truncate_output(text: str, limit: int, keep: int) -> str:
    """AgentBench's rule: longer than `limit` characters -> the first `keep` plus a note."""
    return text if len(text) <= limit else text[:keep] + TRUNCATION_NOTE


class ShellChannel(ABC):
    """A running `bash --login` inside a sandbox, stdout and stderr merged."""

    @abstractmethod
    async def send(self, data: bytes) -> None: ...

    @abstractmethod
    async def receive(self) -> bytes:
        """The next chunk of output; b"" once the shell has exited."""

    @abstractmethod
    async def interrupt(self) -> None:
        """Kills the processes the shell started for the current command (the shell survives)."""

    @abstractmethod
    async def kill(self) -> None:
        """Kills the shell; idempotent."""


class _Capture:
    """Head of the output (bounded) plus a short tail in which the end marker is searched."""

    def __init__(self, marker: re.Pattern[bytes]) -> None:
        self.marker, self.head, self.tail, self.total = marker, bytearray(), bytearray(), 0

    def feed(self, chunk: bytes) -> int | None:
        """Adds a chunk; the command's exit code once the marker has arrived."""
        self.tail += chunk
        match = self.marker.search(self.tail)
        body = self.tail[: match.start()] if match else self.tail[:-64]
        room = OUTPUT_CAP_BYTES - len(self.head)
        self.head += body[: max(room, 0)]
        self.total += len(body)
        self.tail = bytearray() if match else self.tail[-64:]
        return int(match.group(1)) if match else None

    def text(self) -> str:
        rest = self.tail if not self.marker.search(self.tail) else b""
        data = bytes(self.head + rest[: max(OUTPUT_CAP_BYTES - len(self.head), 0)])
        return data.decode("utf-8", errors="replace")


class ShellSession:
    """One persistent shell; restarted (files kept) when a command makes it exit."""

    def __init__(self, open_channel: Callable[[], Awaitable[ShellChannel]]) -> None:
        self._open_channel = open_channel
        self._channel: ShellChannel | None = None
        self._opened = False
        self._token = secrets.token_hex(8)
        self._marker = re.compile(rb"\n__RS_" + self._token.encode() + rb"_(\d+)__\n")
        self._lock = asyncio.Lock()

    async def ensure(self) -> ShellChannel:
        """The running shell, started (or restarted after an exit) if need be."""
        async with self._lock:
            return await self._ensure()

    async def _ensure(self) -> ShellChannel:
        if self._channel is None:
            channel = await self._open_channel()
            # A first round trip: the shell (and the namespaces around it) are fully set up.
            code, _ = await self._exchange(channel, "true", STARTUP_TIMEOUT_S, _Capture(self._marker))
            if code is None:
                await channel.kill()
                raise SandboxCrashed("the sandbox's shell did not start")
            self._channel, self._opened = channel, True
        return self._channel

    async def _exchange(self, channel: ShellChannel, command: str, timeout_s: float,
                        capture: _Capture) -> tuple[int | None, bool]:
        encoded = base64.b64encode(command.encode()).decode()
        line = (
            f'eval "$(printf %s {encoded} | base64 -d)" </dev/null; '
            f"printf '\\n__RS_{self._token}_%s__\\n' \"$?\"\n"
        )
        try:
            await channel.send(line.encode())
        except (BrokenPipeError, ConnectionError, OSError):
            return None, False
        return await self._read(channel, capture, timeout_s)

    async def run(self, command: str, timeout_s: float) -> ExecResult:
        async with self._lock:
            restarted = self._channel is None and self._opened
            channel = await self._ensure()
            capture = _Capture(self._marker)
            code, timed_out = await self._exchange(channel, command, timeout_s, capture)
            if code is None and timed_out:
                await channel.interrupt()
                code, _ = await self._read(channel, capture, INTERRUPT_GRACE_S)
            if code is None:  # the shell exited (`exit`, `kill -9 -1`) or is wedged: next call gets a new one
                await self._drop()
                code = -1
            return ExecResult(code, capture.text(), timed_out=timed_out, shell_restarted=restarted)

    async def _read(self, channel: ShellChannel, capture: _Capture, timeout_s: float) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, True
            try:
                chunk = await asyncio.wait_for(channel.receive(), left)
            except asyncio.TimeoutError:
                return None, True
            if not chunk:
                return None, False
            code = capture.feed(chunk)
            if code is not None:
                return code, False

    async def _drop(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.kill()

    async def close(self) -> None:
        await self._drop()


class Sandbox(ABC):
    """One session's sandbox: a persistent shell and independent processes over the same files."""

    backend: str = ""

    def __init__(self) -> None:
        self.shell = ShellSession(self._open_shell)

    @abstractmethod
    async def _open_shell(self) -> ShellChannel: ...

    @abstractmethod
    async def run(self, argv: Sequence[str], timeout_s: float) -> ExecResult:
        """An independent process (AgentBench's exec_run): its own stdin (empty), working dir /."""

    @abstractmethod
    async def _release(self) -> None:
        """Kills every process and removes every file and mount of the sandbox."""

    async def close(self) -> None:
        """Idempotent; never raises for an already-dead sandbox."""
        await self.shell.close()
        await self._release()


class SandboxBackend(ABC):
    """Makes sandboxes from an AgentBench image name (`default`, `packages`, `ubuntu`)."""

    name: str = ""

    @abstractmethod
    async def open(self, image: str) -> Sandbox:
        """A fresh sandbox; raises SandboxCrashed when it cannot be made."""

    async def aclose(self) -> None:
        """Releases backend-wide resources (client connections)."""


_rootfs_cache: dict[str, str] = {}


async def rootfs_for(script: str) -> str:
    """The root filesystem directory (one for all of AgentBench's images), built on first use."""
    if script not in _rootfs_cache:
        process = await asyncio.create_subprocess_exec(
            script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await process.communicate()
        if process.returncode != 0:
            raise SandboxCrashed(f"{script} failed: {err.decode(errors='replace')[-500:]}")
        _rootfs_cache[script] = out.decode().strip().splitlines()[-1]
    return _rootfs_cache[script]
