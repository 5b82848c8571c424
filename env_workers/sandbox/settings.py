"""Settings of the OS-task sandboxes (AgentBench's OS interaction containers, reproduced locally)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


class SandboxSettings(BaseModel):
    """Which backend runs OS tasks and the limits every sandbox gets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["auto", "docker", "bwrap"] = "auto"
    """auto: Docker when an engine answers, else bubblewrap (AgentBench uses Docker containers)."""
    rootfs_script: Path = REPO_ROOT / "infra" / "sandbox" / "build-rootfs.sh"
    """Builds (once) and prints the Debian root filesystem standing in for AgentBench's images."""
    docker_host: str | None = None
    """Docker endpoint (unix://...); None: the SDK's default (AgentBench: docker.from_env())."""
    image_prefix: str = "rollstream-os"
    """Docker image name for imported root filesystems (AgentBench: local-os/<image>)."""
    command_timeout_s: float = 30.0
    """Wall time of one bash_action before its processes are killed (AgentBench's 30 s time_limit)."""
    script_timeout_s: float = 60.0
    """Wall time of one init, example or check script (AgentBench sets none; bounded here)."""
    output_limit: int = 800
    """Outputs longer than this are cut to output_keep chars plus a note (AgentBench: 800)."""
    output_keep: int = 780
    """Characters kept of a long output (AgentBench: 780)."""
    memory_bytes: int = 512 * 1024 * 1024
    """Address-space / container memory limit per sandbox (not set by AgentBench)."""
    max_processes: int = 256
    """Process-count limit per sandbox (RLIMIT_NPROC / pids_limit; not set by AgentBench)."""
    cpu_seconds: int = 120
    """CPU seconds per process (RLIMIT_CPU); Docker gets cpus instead."""
    cpus: float = 1.0
    """CPU share of one Docker container (nano_cpus)."""
    disk_bytes: int = 256 * 1024 * 1024
    """Size of the session's writable tmpfs (files the task and the agent write)."""
    file_bytes: int = 128 * 1024 * 1024
    """Largest single file a sandboxed process may write (RLIMIT_FSIZE)."""
    open_files: int = 1024 * 1024
    """bubblewrap's RLIMIT_NOFILE: the 1048576 Docker gave AgentBench's containers (data/4/Q09 uses fd 123321)."""
    max_processes_all: int = 4096
    """RLIMIT_NPROC of the bubblewrap uid, all sandboxes together: the backstop without cgroups."""
    uid_base: int = 200_000
    """Unprivileged host uid that bubblewrap sandboxes run as (root inside; owns the root fs)."""
    work_dir: Path | None = None
    """Parent of the per-session temp folders; None: the system temp dir."""
    cgroup_root: Path = Path("/sys/fs/cgroup")
    """cgroup mount (v2, or v1 controllers below it); per-session pids/memory/cpu limits when writable."""
