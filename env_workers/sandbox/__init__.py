"""Sandboxes for OS tasks: Docker containers when an engine answers, bubblewrap otherwise."""

from __future__ import annotations

import logging

from env_workers.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxCrashed
from env_workers.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)

__all__ = ["ExecResult", "Sandbox", "SandboxBackend", "SandboxCrashed", "SandboxSettings", "make_backend"]


def make_backend(settings: SandboxSettings) -> SandboxBackend:
    """The configured backend; `auto` picks Docker when its engine answers a ping, else bubblewrap."""
    if settings.backend in ("docker", "auto"):
        from env_workers.sandbox.docker_backend import DockerBackend, docker_reachable

        if settings.backend == "docker" or docker_reachable(settings.docker_host):
            return DockerBackend(settings)
        log.info("no Docker engine reachable; OS tasks run under bubblewrap")
    from env_workers.sandbox.bwrap import BwrapBackend

    return BwrapBackend(settings)
