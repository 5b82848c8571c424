"""bubblewrap backend: a copy-on-write view of the shared root filesystem on a bounded tmpfs.

Isolation (what Docker gives AgentBench, rebuilt from kernel parts):
- namespaces: `--unshare-all` (user, pid, net with loopback only, ipc, uts, cgroup); the pid
  namespace dies with its init, so killing bwrap kills every process of the session;
- identity: sandboxes run as one unprivileged host uid (`uid_base`), mapped to root inside; the
  root filesystem is chowned to it once, so inside it is root's. Host root would be exempt from
  RLIMIT_NPROC; this uid is not;
- files: per session, a tmpfs of `disk_bytes` (the disk limit) holds an overlayfs upper layer
  over the read-only root filesystem; that overlay is the sandbox's `/`. The shared root
  filesystem is never written; the tmpfs is unmounted and removed at the end;
- limits: RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CPU per process, RLIMIT_NOFILE as Docker's (capped by
  the host: `open_files_limit`), RLIMIT_NPROC over all sandboxes as a host-wide backstop, and a
  per-session cgroup (v2, else v1 pids/memory/cpu) when writable; wall time per command in
  ShellSession.
Independent scripts (init, check) enter the shell's namespaces with nsenter (as the sandbox's
root, under the same limits), as AgentBench's exec_run enters its container.

A worker killed with SIGKILL cannot unmount its sessions' tmpfs and overlay nor remove their
cgroups: both carry the owning process id in their names (`rollstream-os-<pid>-...`,
`rollstream-<pid>-...`), and every new backend first sweeps those whose owner is gone
(`sweep_orphans`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from env_workers.sandbox.base import OUTPUT_CAP_BYTES, ExecResult, Sandbox, SandboxBackend, SandboxCrashed, ShellChannel, process_gone, rootfs_for
from env_workers.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "USER": "root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "HOSTNAME": "sandbox",
}


def _mount(source: str, target: str, fstype: str, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), 0, data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype} on {target}: {os.strerror(errno)}")


def _umount(target: Path) -> None:
    _libc.umount2(str(target).encode(), MNT_DETACH)


CAP_SYS_RESOURCE = 24


def _has_capability(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def open_files_limit(wanted: int) -> int:
    """The RLIMIT_NOFILE sandboxes get: `wanted`, or the host's hard limit when this process may
    not raise it (no CAP_SYS_RESOURCE, as in some VMs): above it prlimit fails and bwrap never starts."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or wanted <= hard or _has_capability(CAP_SYS_RESOURCE):
        return wanted
    log.warning("open-file limit of OS sandboxes capped at the host's %d (wanted %d)", hard, wanted)
    return hard


def _children_map() -> dict[int, list[int]]:
    """Every process's children, by a scan of all of /proc: the fallback where the kernel has no
    /proc/PID/task/TID/children files (CONFIG_PROC_CHILDREN)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _has_children_files() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


HAS_CHILDREN_FILES = _has_children_files()


def children_of(pid: int) -> list[int]:
    """The children of `pid` (of all its threads), read from its own /proc files: a cost of its
    threads, not of every process on the host. [] when it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as listed:
                found += [int(child) for child in listed.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` on the host, parents before children.

    Walks down from `pid` through the kernel's children files where it has them. The whole-/proc
    scan it replaces cost O(all processes) per call, and sandbox starts poll this every 5 ms: with
    1,359 sandboxes open (4,000 processes) a start took 8.7 s at the median (bench envs, 64 in
    flight). Like the scan, it is a snapshot: a process forked meanwhile can be missed."""
    if not HAS_CHILDREN_FILES:
        children = _children_map()
        lookup = lambda parent: children.get(parent, [])  # noqa: E731
    else:
        lookup = children_of
    found, queue = [], [pid]
    while queue:
        for child in lookup(queue.pop(0)):
            found.append(child)
            queue.append(child)
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Cgroup:
    """Per-session pids/memory/cpu limits in cgroup v2, or v1 controllers, when the host lets us."""

    def __init__(self, root: Path, name: str, settings: SandboxSettings) -> None:
        if (root / "cgroup.controllers").exists():
            limits = {root: {"pids.max": settings.max_processes, "memory.max": settings.memory_bytes,
                             "cpu.max": f"{int(settings.cpus * 100_000)} 100000"}}
        else:
            limits = {root / "pids": {"pids.max": settings.max_processes},
                      root / "memory": {"memory.limit_in_bytes": settings.memory_bytes},
                      root / "cpu": {"cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": int(settings.cpus * 100_000)}}
        self.paths: list[Path] = []
        for hierarchy, files in limits.items():
            if not os.access(hierarchy, os.W_OK) or not (hierarchy / "cgroup.procs").exists():
                continue
            path = hierarchy / f"rollstream-{name}"
            try:
                path.mkdir()
                self.paths.append(path)
                for file, value in files.items():
                    if (path / file).exists():
                        (path / file).write_text(str(value))
            except OSError as error:
                log.warning("cgroup limits in %s unavailable: %s", hierarchy, error)

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            try:
                found.update(int(line) for line in (path / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return sorted(found)

    def remove(self) -> None:
        deadline = time.monotonic() + 5.0
        while (left := self.pids()) and time.monotonic() < deadline:
            _kill(left)
            time.sleep(0.01)
        for path in self.paths:
            try:
                path.rmdir()
            except OSError as error:
                log.warning("cannot remove cgroup %s: %s", path, error)


class _BwrapShell(ShellChannel):
    def __init__(self, process: asyncio.subprocess.Process, init_pid: int) -> None:
        self.process, self.init_pid = process, init_pid

    async def send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        await self.process.stdin.drain()

    async def receive(self) -> bytes:
        assert self.process.stdout is not None
        return await self.process.stdout.read(65536)

    async def interrupt(self) -> None:
        # bwrap (outside) -> bwrap (pid 1 inside) -> bash -> the command's processes.
        shells = [pid for pid in descendants(self.process.pid) if _comm(pid) == "bash"]
        if shells:
            _kill(descendants(shells[0]))

    async def kill(self) -> None:
        if self.process.returncode is None:
            # The namespace's init first: the outer bwrap reaps it and exits. Killing the outer one
            # first would orphan the init to host pid 1, which need not reap it (a zombie).
            _kill([self.init_pid])
            try:
                await asyncio.wait_for(self.process.wait(), 5.0)
            except asyncio.TimeoutError:
                _kill([self.process.pid])
                await self.process.wait()


class BwrapSandbox(Sandbox):
    backend = "bwrap"

    def __init__(self, settings: SandboxSettings, rootfs: str, open_files: int) -> None:
        super().__init__()
        self.settings = settings
        self.rootfs = rootfs
        self.open_files = open_files
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:16]}"  # the owner's pid: see sweep_orphans
        self.uid = settings.uid_base
        self.dir = Path(tempfile.mkdtemp(prefix=f"rollstream-os-{os.getpid()}-", dir=settings.work_dir))
        self.root = self.dir / "root"
        self.cgroup: Cgroup | None = None
        self._processes: set[asyncio.subprocess.Process] = set()
        self._released = False

    def prepare(self) -> None:
        """Blocking: the bounded tmpfs and the overlay root on it."""
        _mount("tmpfs", str(self.dir), "tmpfs", f"size={self.settings.disk_bytes},mode=0755")
        for name in ("upper", "work", "root"):
            (self.dir / name).mkdir()
        os.chown(self.dir / "upper", self.uid, self.uid)
        _mount("overlay", str(self.root), "overlay",
               f"lowerdir={self.rootfs},upperdir={self.dir / 'upper'},workdir={self.dir / 'work'}")
        self.cgroup = Cgroup(self.settings.cgroup_root, self.id, self.settings)

    def _argv(self, command: Sequence[str]) -> list[str]:
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--uid", "0", "--gid", "0",
                "--hostname", "sandbox", "--bind", str(self.root), "/", "--proc", "/proc", "--dev", "/dev",
                # Unreadable in a user namespace; an empty dir keeps `find /` as quiet as in Docker.
                "--tmpfs", "/proc/tty/driver",
                "--chdir", "/", "--clearenv"]
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        return argv + list(command)

    def _confined(self, command: Sequence[str], as_sandbox_uid: bool) -> list[str]:
        """`command` inside the session's cgroup, under its rlimits, optionally as the sandbox uid.

        Done with sh/prlimit/setpriv rather than a preexec_fn: forking a threaded Python process
        (asyncio.to_thread is in use) and running Python code in the child can deadlock.
        """
        s = self.settings
        joins = "".join(f"echo $$ > {shlex.quote(str(path / 'cgroup.procs'))}; "
                        for path in (self.cgroup.paths if self.cgroup else []))
        limits = ["prlimit", f"--nproc={s.max_processes_all}", f"--as={s.memory_bytes}",
                  f"--fsize={s.file_bytes}", f"--cpu={s.cpu_seconds}", f"--nofile={self.open_files}"]
        uid = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"] if as_sandbox_uid else []
        return ["sh", "-c", joins + 'exec "$@"', "sh", *limits, *uid, *command]

    async def _spawn(self, command: Sequence[str], stdin: int) -> asyncio.subprocess.Process:
        if self._released:
            raise SandboxCrashed("sandbox already released")
        try:
            process = await asyncio.create_subprocess_exec(
                *self._confined(self._argv(command), as_sandbox_uid=True), stdin=stdin,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as error:
            raise SandboxCrashed(f"cannot start bwrap: {error}") from error
        self._processes.add(process)
        return process

    async def _open_shell(self) -> ShellChannel:
        process = await self._spawn(["bash", "--login"], asyncio.subprocess.PIPE)
        # sh -> prlimit -> setpriv exec into bwrap, which then forks the namespace's init: wait for it.
        deadline = time.monotonic() + 10.0
        while not (inside := descendants(process.pid)):
            if process.returncode is not None or time.monotonic() > deadline:
                _kill([process.pid])
                raise SandboxCrashed("bwrap did not start")
            await asyncio.sleep(0.005)
        return _BwrapShell(process, inside[0])

    async def run(self, argv: Sequence[str], timeout_s: float) -> ExecResult:
        # AgentBench's exec_run shares the container with the shell (its files and its processes):
        # enter the namespaces of the shell's sandbox rather than making a second one.
        channel = await self.shell.ensure()
        assert isinstance(channel, _BwrapShell)
        command = ["nsenter", "--target", str(channel.init_pid), "--user", "--mount", "--pid", "--net", "--ipc", "--uts",
                   "--root", "--wdns=/", "--", "/usr/bin/env", "-i",
                   *(f"{key}={value}" for key, value in ENV.items()), *argv]
        # Output goes to a file, not a pipe: background jobs a script leaves running (`(sleep 60) &`)
        # would hold a pipe open, and asyncio waits for every pipe to close. They keep running.
        with tempfile.TemporaryFile() as output:
            try:
                # nsenter needs host root to enter; inside it becomes the sandbox's root (the sandbox uid).
                process = await asyncio.create_subprocess_exec(
                    *self._confined(command, as_sandbox_uid=False), stdin=asyncio.subprocess.DEVNULL,
                    stdout=output, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                )
            except (OSError, subprocess.SubprocessError) as error:
                raise SandboxCrashed(f"cannot enter the sandbox: {error}") from error
            self._processes.add(process)
            timed_out = False
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                _kill([process.pid, *descendants(process.pid)])
                await process.wait()
            finally:
                self._processes.discard(process)
            output.seek(0)
            text = output.read(OUTPUT_CAP_BYTES).decode("utf-8", errors="replace")
        return ExecResult(-1 if timed_out else process.returncode or 0, text, timed_out=timed_out)

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        for process in list(self._processes):
            if process.returncode is None:
                _kill([process.pid])
                await process.wait()
        await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        # A pid namespace dies with its init, asynchronously; the cgroup waits until it is empty.
        if self.cgroup is not None:
            self.cgroup.remove()
        _umount(self.root)
        _umount(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)


def _owner_gone(name: str, prefix: str) -> bool:
    """Whether the process whose pid follows `prefix` in `name` has exited."""
    pid = name[len(prefix):].split("-", 1)[0]
    return pid.isdigit() and process_gone(int(pid))  # a name without a pid: not ours to judge


def sweep_orphans(settings: SandboxSettings) -> int:
    """Unmounts and removes the session directories and cgroups of env workers that died without
    cleaning up (SIGKILL, OOM); returns how many sessions were swept."""
    swept = 0
    base = Path(settings.work_dir or tempfile.gettempdir())
    for path in base.glob("rollstream-os-*"):
        if path.is_dir() and _owner_gone(path.name, "rollstream-os-"):
            _umount(path / "root")
            _umount(path)
            shutil.rmtree(path, ignore_errors=True)
            swept += 1
    root = settings.cgroup_root
    for hierarchy in (root, root / "pids", root / "memory", root / "cpu"):
        for path in hierarchy.glob("rollstream-*") if hierarchy.is_dir() else ():
            if path.is_dir() and _owner_gone(path.name, "rollstream-"):
                try:
                    _kill([int(p) for p in (path / "cgroup.procs").read_text().split()])
                    path.rmdir()
                except OSError as error:
                    log.warning("cannot remove the orphaned cgroup %s: %s", path, error)
    return swept


def own_rootfs(rootfs: str, uid: int) -> None:
    """Once per root filesystem: make it the sandbox uid's, so that it is root's inside the sandbox."""
    if os.stat(rootfs).st_uid != uid:
        subprocess.run(["chown", "-R", "-h", f"{uid}:{uid}", rootfs], check=True)


class BwrapBackend(SandboxBackend):
    name = "bwrap"

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        if shutil.which("bwrap") is None:
            raise SandboxCrashed("bwrap is not installed (apt-get install -y bubblewrap)")
        self._owned: set[str] = set()
        self.open_files = open_files_limit(settings.open_files)
        swept = sweep_orphans(settings)
        if swept:
            log.warning("cleaned up %d sandbox sessions left behind by env workers that died", swept)

    async def open(self, image: str) -> Sandbox:
        rootfs = await rootfs_for(str(self.settings.rootfs_script))
        if rootfs not in self._owned:
            await asyncio.to_thread(own_rootfs, rootfs, self.settings.uid_base)
            self._owned.add(rootfs)
        sandbox = BwrapSandbox(self.settings, rootfs, self.open_files)
        try:
            await asyncio.to_thread(sandbox.prepare)
        except Exception as error:
            await sandbox.close()
            raise SandboxCrashed(f"cannot prepare bwrap sandbox: {error}") from error
        return sandbox
