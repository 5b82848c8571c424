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

A family that cannot run here (its module or its sandbox is missing, a start fails, it exceeds
`--timeout-s`) is reported as not measured, with the reason. A timeout cancels the session being
started; what its `open` had acquired is released only if the family's `open` cleans up on
cancellation (Environment.start catches Exception, not CancelledError).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from env_workers.envs import registry
from env_workers.envs.base import Environment, EnvSettings
from pipeline.bench.envs_logic import FAMILY_SPLITS, labels, measure, percentile, summary, timed
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


def opener(family: str, backend: str | None,
           settings: EnvSettings) -> Callable[[], tuple[Environment, Sequence[Mapping[str, Any]]]]:
    """What opens one measurement's family: its split's samples, then its environment (on `backend`
    for os)."""

    def open_family() -> tuple[Environment, Sequence[Mapping[str, Any]]]:
        samples = registry.samples(family, FAMILY_SPLITS[family], settings)
        env = _os_environment(backend, settings) if backend is not None else registry.environment(family, settings)
        return env, samples

    return open_family


async def run_bench(families: Sequence[str], settings: EnvSettings, n: int, concurrency: int, timeout_s: float,
                    on_step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The whole report: bare process, every family, and the ratio of their medians."""
    on_step("bare process")
    bare = await bare_process(max(n, 20), concurrency)
    results: dict[str, dict[str, Any]] = {}
    for label, family, backend in labels(families):
        on_step(label)
        results[label] = await measure(opener(family, backend, settings), n, concurrency, timeout_s)
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


@app.command("envs")
def bench_envs(
    families: str = typer.Option(",".join(FAMILY_SPLITS), "--families", help="Comma-separated families to measure."),
    sessions: int = typer.Option(20, "--sessions", min=1, help="Sessions per family for each figure."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Sessions in flight for sessions/s."),
    timeout_s: float = typer.Option(300.0, "--timeout-s", min=1, help="Give up on a family after this long."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
) -> None:
    """Session start latency p50/p99 and sessions/s per family, beside a bare process start.

    Example: rollstream bench envs --families calc,webshop --sessions 10 --json
    """
    names = [f.strip() for f in families.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAMILY_SPLITS]
    if unknown or not names:
        typer.echo(f"rollstream bench envs: unknown families {unknown}; known: {', '.join(FAMILY_SPLITS)}", err=True)
        raise typer.Exit(code=2)
    show = not quiet and sys.stderr.isatty()
    err = Console(stderr=True)
    report = asyncio.run(run_bench(names, load_config().envs, sessions, concurrency, timeout_s,
                                   on_step=lambda label: show and err.print(f"measuring {label} ...")))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_table(report)
