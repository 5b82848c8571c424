"""The whole `rollstream` command line: every subcommand registered on one app (pipeline/cli/__init__.py
hands it out as `pipeline.cli.app` and `pipeline.cli.main`)."""

from __future__ import annotations

from pipeline.bench import bus as bench_bus
from pipeline.bench import envs as bench_envs
from pipeline.bench import chaos as bench_chaos
from pipeline.bench import faults as bench_faults
from pipeline.bench import learner as bench_learner
from pipeline.bench import peer as bench_peer
from pipeline.bench import pipeline as bench_pipeline
from pipeline.bench import precision as bench_precision
from pipeline.bench import rollout as bench_rollout
from pipeline.bench import scale as bench_scale
from pipeline.bench import streams as bench_streams
from pipeline.bench import weights as bench_weights
from pipeline.cli import advantages as advantages_cmd
from pipeline.cli import alerts as alerts_cmd
from pipeline.cli import dispatch as dispatch_cmd
from pipeline.cli import engine as engine_cmd
from pipeline.cli import env as env_cmd
from pipeline.cli import env_worker as env_worker_cmd
from pipeline.cli import eval as eval_cmd
from pipeline.cli import infra as infra_cmd
from pipeline.cli import learner as learner_cmd
from pipeline.cli import loss as loss_cmd
from pipeline.cli import model as model_cmd
from pipeline.cli import process as process_cmd
from pipeline.cli import proxy as proxy_cmd
from pipeline.cli import replay as replay_cmd
from pipeline.cli import report as report_cmd
from pipeline.cli import smoke
from pipeline.cli import streams as streams_cmd
from pipeline.cli import study as study_cmd
from pipeline.cli import tensorboard as tensorboard_cmd
from pipeline.cli import up as up_cmd
from pipeline.cli.toolkit import ROOT, App

app = App(
    name=ROOT,
    help="Reinforcement learning for LLM agents as an event-streaming dataflow on Apache Kafka.",
    no_args_is_help=True,
)
bench_app = App(help="Benchmarks: each prints a table, or one JSON object with --json.", no_args_is_help=True)

app.add_typer(infra_cmd.app, name="infra")
app.add_typer(bench_app, name="bench")
app.add_typer(env_cmd.app, name="env")
app.add_typer(model_cmd.app, name="model")
app.command("smoke")(smoke.smoke)
app.command("advantages")(advantages_cmd.advantages)
app.command("loss")(loss_cmd.loss)
bench_app.command("bus")(bench_bus.bench_bus)
bench_app.command("learner")(bench_learner.bench_learner)
bench_app.command("envs")(bench_envs.bench_envs)
app.command("learner")(learner_cmd.learner)
app.command("engine")(engine_cmd.engine)
app.command("env-worker")(env_worker_cmd.env_worker)
app.command("proxy")(proxy_cmd.proxy)
app.command("process")(process_cmd.process)
app.add_typer(streams_cmd.app, name="streams")
app.command("dispatch")(dispatch_cmd.dispatch)
bench_app.command("streams")(bench_streams.bench_streams)
bench_app.command("rollout")(bench_rollout.bench_rollout)
bench_app.command("faults")(bench_faults.bench_faults)
bench_app.command("chaos")(bench_chaos.bench_chaos)
bench_app.command("scale")(bench_scale.bench_scale)
bench_app.command("pipeline")(bench_pipeline.bench_pipeline)
bench_app.command("peer")(bench_peer.bench_peer)
bench_app.command("weights")(bench_weights.bench_weights)
bench_app.command("precision")(bench_precision.bench_precision)
app.command("up")(up_cmd.up)
app.command("study")(study_cmd.study)
app.command("eval")(eval_cmd.eval_checkpoint)
app.command("report")(report_cmd.report)
app.command("tensorboard")(tensorboard_cmd.tensorboard)
app.add_typer(replay_cmd.app, name="replay")
app.add_typer(alerts_cmd.app, name="alerts")


def main() -> None:
    app(prog_name=ROOT)
