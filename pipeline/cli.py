"""The `rollstream` command line.

Every subcommand lives in its own module and is registered here. Conventions (STYLE.md):
machine-readable output with `--json` on stdout, progress and logs on stderr, a user mistake
ends in one line and a non-zero exit, and each command's help shows an example.
"""

from __future__ import annotations

import typer

from pipeline import (
    advantages_cmd,
    bench_bus,
    bench_envs,
    bench_learner,
    bench_rollout,
    bench_streams,
    dispatch_cmd,
    engine_cmd,
    env_cmd,
    env_worker_cmd,
    infra_cmd,
    learner_cmd,
    model_cmd,
    smoke,
    streams_cmd,
)

app = typer.Typer(
    name="rollstream",
    help="Reinforcement learning for LLM agents as an event-streaming dataflow on Apache Kafka.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: each prints a table, or one JSON object with --json.", no_args_is_help=True)

app.add_typer(infra_cmd.app, name="infra")
app.add_typer(bench_app, name="bench")
app.add_typer(env_cmd.app, name="env")
app.add_typer(model_cmd.app, name="model")
app.command("smoke")(smoke.smoke)
app.command("advantages")(advantages_cmd.advantages)
bench_app.command("bus")(bench_bus.bench_bus)
bench_app.command("learner")(bench_learner.bench_learner)
bench_app.command("envs")(bench_envs.bench_envs)
app.command("learner")(learner_cmd.learner)
app.command("engine")(engine_cmd.engine)
app.command("env-worker")(env_worker_cmd.env_worker)
app.add_typer(streams_cmd.app, name="streams")
app.command("dispatch")(dispatch_cmd.dispatch)
bench_app.command("streams")(bench_streams.bench_streams)
bench_app.command("rollout")(bench_rollout.bench_rollout)


def _not_built(name: str, issue: int) -> None:
    """Registers a subcommand that a later issue fills in: it fails loudly instead of pretending."""

    def command() -> None:
        typer.echo(f"rollstream {name}: not built yet (issue #{issue})", err=True)
        raise typer.Exit(code=2)

    command.__doc__ = f"Not built yet (issue #{issue})."
    app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


for _name, _issue in [
    ("up", 7), ("eval", 7), ("replay", 7), ("report", 7),
]:
    _not_built(_name, _issue)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
