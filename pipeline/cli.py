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
    bench_faults,
    bench_learner,
    bench_pipeline,
    bench_rollout,
    bench_scale,
    bench_streams,
    dispatch_cmd,
    engine_cmd,
    env_cmd,
    env_worker_cmd,
    eval_cmd,
    infra_cmd,
    learner_cmd,
    model_cmd,
    replay_cmd,
    report_cmd,
    smoke,
    streams_cmd,
    up_cmd,
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
bench_app.command("faults")(bench_faults.bench_faults)
bench_app.command("scale")(bench_scale.bench_scale)
bench_app.command("pipeline")(bench_pipeline.bench_pipeline)
app.command("up")(up_cmd.up)
app.command("eval")(eval_cmd.eval_checkpoint)
app.command("report")(report_cmd.report)
app.add_typer(replay_cmd.app, name="replay")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
