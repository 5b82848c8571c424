"""`rollstream bench envs`: what starting an environment session costs, per family, on this machine.

For each family (calc, db, kg, webshop, alfworld, and os once per sandbox backend) it starts and
ends sessions through the environment API: first one warm-up session (it pays the one-off loads
that a start does, such as the KG or the TextWorld imports; reported as `first_start_ms`; loading
the split's samples, which builds the WebShop catalog, is not timed), then `--sessions`
sessions one after another (start latency p50/p99 in ms, start only), then the same number with
`--concurrency` in flight (sessions/s, start + end). Samples cycle through the family's split.
Beside them, in the same run, the cost of starting a bare process: `/bin/true` through
asyncio.create_subprocess_exec, timed the same ways. The headline `ratio` is the median of the
families' p50 start latencies / the bare process's p50.

Then the held phase, the issue's "N concurrent sessions per family on one env worker"
(`families[f]["held"]`, envs_logic.held_sessions): `--held` sessions (by default as many as
`--sessions`) open at the same time in this one process, started `--held-concurrency` at a time;
`--held-steps` rounds of the family's golden action in every one; then all ended. It reports start
latency under that load, steps/s, memory per session (this process's RSS growth, its child
processes' RSS for sandboxes, the host's MemAvailable drop) and what was left once they ended:
sessions not ended, new child processes and file descriptors, and for os its sandboxes' mounts,
temp dirs and cgroups (bwrap) or containers (Docker). A family stops short of N at a failing
start, at `--memory-guard` (the share of the MemAvailable read when its held phase began that may
be used) or after `--timeout-s` of opening, and says which (`reached`, `stopped_by`).

A family that cannot run here (its module or its sandbox is missing, a start fails, it exceeds
`--timeout-s`) is reported as not measured, with the reason. A timeout cancels the session being
started; what its `open` had acquired is released only if the family's `open` cleans up on
cancellation (Environment.start catches Exception, not CancelledError).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from env_workers.envs import registry
from env_workers.envs.base import Environment, EnvSettings
from pipeline.bench.envs_logic import FAMILY_SPLITS, Held, Memory, labels, measure, percentile, summary, timed
from pipeline.run.config import load_config

BARE_COMMAND = "/bin/true"

app = typer.Typer(help="Environment session start cost against a bare process start.")


async def bare_process(n: int, concurrency: int) -> dict[str, Any]:
    """Start latency of /bin/true (spawn to exit, ms) one at a time, and processes/s with `concurrency` in flight."""

    async def one(_: int) -> float:
        start = time.perf_counter()
        process = await asyncio.create_subprocess_exec(BARE_COMMAND)
        await process.wait()
        return (time.perf_counter() - start) * 1000

    latencies, _ = await timed(n, 1, one)
    _, wall = await timed(n, concurrency, one)
    return {"command": BARE_COMMAND, "runs": n, "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "per_s": n / wall}


def _os_environment(backend: str, settings: EnvSettings) -> Environment:
    """The os family on one sandbox backend; raises when the backend cannot run here."""
    from env_workers.envs import os_env
    from env_workers.sandbox import SandboxSettings

    if backend == "docker":
        from env_workers.sandbox.docker_backend import docker_reachable

        if not docker_reachable(None):
            raise RuntimeError("no Docker engine reachable")
    return os_env.make(settings, SandboxSettings(backend=backend))


class ProcHost:
    """The held phase's readings of this machine (psutil over /proc) around one family's environment."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.me = psutil.Process()

    def memory(self) -> Memory:
        gc.collect()  # garbage of earlier phases is not the held sessions' memory
        children = 0
        for child in self.me.children(recursive=True):
            try:
                children += child.memory_info().rss
            except psutil.Error:  # it exited between the listing and the read
                continue
        return Memory(self.me.memory_info().rss, children, psutil.virtual_memory().available)

    def available(self) -> int:
        return psutil.virtual_memory().available

    def leftovers(self) -> dict[str, frozenset[str]]:
        found = {"processes": frozenset(str(p.pid) for p in self.me.children(recursive=True)),
                 "fds": frozenset(os.listdir("/proc/self/fd"))}
        return found | sandbox_leftovers(self.env)


def sandbox_leftovers(env: Environment) -> dict[str, frozenset[str]]:
    """What this process's os sandboxes hold outside it, found by the names the backends give them
    (each carries its owner's pid: env_workers/sandbox/bwrap.py, docker_backend.py); {} for other families."""
    from env_workers.envs.os_env import OsEnvironment

    if not isinstance(env, OsEnvironment):
        return {}
    if env.backend.name == "docker":
        from env_workers.sandbox.docker_backend import OWNER_LABEL, owner

        listed = env.backend.client.containers.list(  # type: ignore[attr-defined]
            all=True, filters={"label": f"{OWNER_LABEL}={owner()}"})
        return {"containers": frozenset(container.id for container in listed)}
    settings, pid = env.sandbox_settings, os.getpid()
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = frozenset(line.split()[4] for line in mountinfo if f"/rollstream-os-{pid}-" in line)
    work = Path(settings.work_dir or tempfile.gettempdir())
    root = settings.cgroup_root
    cgroups = frozenset(str(path) for hierarchy in (root, root / "pids", root / "memory", root / "cpu")
                        if hierarchy.is_dir() for path in hierarchy.glob(f"rollstream-{pid}-*"))
    return {"mounts": mounts, "temp_dirs": frozenset(str(path) for path in work.glob(f"rollstream-os-{pid}-*")),
            "cgroups": cgroups}


def opener(family: str, backend: str | None,
           settings: EnvSettings) -> Callable[[], tuple[Environment, Sequence[Mapping[str, Any]]]]:
    """What opens one measurement's family: its split's samples, then its environment (on `backend`
    for os)."""

    def open_family() -> tuple[Environment, Sequence[Mapping[str, Any]]]:
        samples = registry.samples(family, FAMILY_SPLITS[family], settings)
        env = _os_environment(backend, settings) if backend is not None else registry.environment(family, settings)
        return env, samples

    return open_family


def held_for(family: str, held: int, concurrency: int, steps: int, guard: float,
             on_open: Callable[[int, int], None]) -> Held | None:
    """The held phase of one family: its golden policy acts, ProcHost reads the machine; None for 0 sessions."""
    if held == 0:
        return None
    return Held(held, concurrency, steps, guard, policy=lambda sample: registry.family(family).golden(sample),
                host=ProcHost, on_open=on_open)


async def run_bench(families: Sequence[str], settings: EnvSettings, n: int, concurrency: int, timeout_s: float,
                    on_step: Callable[[str], None] = lambda _: None, held: int | None = None,
                    held_concurrency: int = 64, held_steps: int = 1, memory_guard: float = 0.8,
                    on_open: Callable[[str, int, int], None] = lambda label, opened, wanted: None) -> dict[str, Any]:
    """The whole report: bare process, every family (with its held phase of `held` sessions, `n`
    when None, none when 0), and the ratio of their medians."""
    on_step("bare process")
    bare = await bare_process(max(n, 20), concurrency)
    results: dict[str, dict[str, Any]] = {}
    for label, family, backend in labels(families):
        on_step(label)
        phase = held_for(family, n if held is None else held, held_concurrency, held_steps, memory_guard,
                         lambda opened, wanted, label=label: on_open(label, opened, wanted))
        results[label] = await measure(opener(family, backend, settings), n, concurrency, timeout_s, phase)
    return summary(bare, results)


def _print_table(report: dict[str, Any]) -> None:
    table = Table(title="env session start (p50/p99 ms, sessions/s)")
    for column in ("family", "p50 ms", "p99 ms", "per s", "first ms", "note"):
        table.add_column(column, justify="left" if column in ("family", "note") else "right")
    bare = report["bare_process"]
    table.add_row(f"bare {bare['command']}", f"{bare['p50_ms']:.2f}", f"{bare['p99_ms']:.2f}",
                  f"{bare['per_s']:.1f}", "", "baseline")
    for label, r in report["families"].items():
        if r["measured"]:
            table.add_row(label, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['sessions_per_s']:.1f}",
                          f"{r['first_start_ms']:.1f}", "")
        else:
            table.add_row(label, "", "", "", "", f"not measured: {r['reason']}")
    console = Console()
    console.print(table)
    ratio = report["ratio"]
    console.print("ratio (median family p50 / bare process p50): " + ("n/a" if ratio is None else f"{ratio:.2f}"))
    held = {label: r["held"] for label, r in report["families"].items() if r.get("held")}
    if held:
        console.print(_held_table(held))


def _figure(value: float | None, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)  # None and NaN: nothing to show


def _held_table(held: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="sessions held open at once (start ms under load, steps/s, KiB per session, left after end)")
    columns = ("family", "N", "open", "p50 ms", "p99 ms", "steps/s", "rss KiB", "child KiB", "host KiB", "left",
               "stopped by")
    for column in columns:
        table.add_column(column, justify="left" if column in ("family", "stopped by") else "right")
    for label, h in held.items():
        memory = h.get("memory", {})
        cleanup = h.get("cleanup")
        left = "" if cleanup is None else (
            "0" if not any(cleanup.values()) else ", ".join(f"{k} {v}" for k, v in cleanup.items() if v))
        table.add_row(label, str(h["sessions"]), str(h["reached"]), _figure(h.get("start_p50_ms"), ".2f"),
                      _figure(h.get("start_p99_ms"), ".2f"), _figure(h.get("steps_per_s"), ".0f"),
                      _figure(memory.get("rss_kib"), ".1f"), _figure(memory.get("children_rss_kib"), ".1f"),
                      _figure(memory.get("available_drop_kib"), ".1f"), left, h["stopped_by"] or "")
    return table


@app.command("envs")
def bench_envs(
    families: str = typer.Option(",".join(FAMILY_SPLITS), "--families", help="Comma-separated families to measure."),
    sessions: int = typer.Option(
        20, "--sessions", min=1,
        help="Sessions per family: N started one after another (p50/p99), N with --concurrency in flight "
             "(sessions/s), and N held open at the same time (the held phase; --held sets that count alone)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Sessions in flight for sessions/s."),
    held: int | None = typer.Option(
        None, "--held", min=0,
        help="Sessions per family held open at the same time (default: as many as --sessions; 0: no held phase)."),
    held_concurrency: int = typer.Option(
        64, "--held-concurrency", min=1, help="Starts (then steps, then ends) in flight in the held phase."),
    held_steps: int = typer.Option(1, "--held-steps", min=1, help="Rounds of the golden action in every held session."),
    memory_guard: float = typer.Option(
        0.8, "--memory-guard", min=0.01, max=1.0,
        help="Open no more held sessions once this share of the MemAvailable read at the start is used."),
    timeout_s: float = typer.Option(
        300.0, "--timeout-s", min=1,
        help="Give up on a family after this long; the held phase stops opening after this long."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
) -> None:
    """Session start latency p50/p99 and sessions/s per family, beside a bare process start; then
    N sessions per family held open at once: start latency under that load, steps/s, memory per
    session, and that every session was cleaned up.

    Example: rollstream bench envs --families calc,db,kg,webshop --sessions 2000 --json
    """
    names = [f.strip() for f in families.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAMILY_SPLITS]
    if unknown or not names:
        typer.echo(f"rollstream bench envs: unknown families {unknown}; known: {', '.join(FAMILY_SPLITS)}", err=True)
        raise typer.Exit(code=2)
    show = not quiet and sys.stderr.isatty()
    err = Console(stderr=True)

    def opened(label: str, count: int, wanted: int) -> None:
        # A line per tenth: thousands of starts scroll nothing away.
        if show and (count == wanted or count % max(1, wanted // 10) == 0):
            err.print(f"  {label}: {count}/{wanted} sessions open")

    report = asyncio.run(run_bench(names, load_config().envs, sessions, concurrency, timeout_s,
                                   on_step=lambda label: show and err.print(f"measuring {label} ..."),
                                   held=held, held_concurrency=held_concurrency, held_steps=held_steps,
                                   memory_guard=memory_guard, on_open=opened))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_table(report)
