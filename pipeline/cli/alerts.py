"""`rollstream alerts`: a run's behaviour alerts, and resuming a run an alert paused (pipeline/run/alerts.py)."""

from __future__ import annotations

import json

import typer

from pipeline.cli.toolkit import App, ConfigOption, JsonOption, RunOption, fail
from pipeline.run.alerts import read_alerts, send_resume
from pipeline.run.config import load_config
from streams.alerts import describe

app = App(name="alerts", help="Behaviour alerts of a run (streams.alerts rules): list them, resume a paused run.",
          no_args_is_help=True)


@app.command("list")
def list_alerts(
    run: RunOption,
    since: str | None = typer.Option(None, "--from", help="Read from this ISO time or offset (default: the topic's start)."),
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """The run's alerts in the order they were raised, and whether they leave it paused or stopped.

    Example: rollstream alerts list --run r1 --json
    """
    from pipeline.analysis.replay import ReplayError

    cfg = load_config(config)
    try:
        events, hold = read_alerts(cfg.kafka, run, since)
    except (ReplayError, ValueError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps({"run": run, "alerts": events, "paused_by": hold.paused_by,
                               "stopped_by": hold.stopped_by}))
        return
    for alert in events:
        typer.echo(describe(alert))
    state = (f"stopped by alert {hold.stopped_by}" if hold.stopped_by else
             f"paused by alert {hold.paused_by}" if hold.paused_by else "not paused")
    typer.echo(f"run {run}: {len(events)} alert(s); {state}")


@app.command("resume")
def resume(run: RunOption, config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Lift a run's pauses: its dispatcher sends tasks again.

    A run an alert stopped stays stopped. A rule that paused the run fires again only once its figure
    has come back past the threshold and crossed it anew.

    Example: rollstream alerts resume --run r1
    """
    event = send_resume(load_config(config).kafka, run)
    if as_json:
        typer.echo(json.dumps(event))
    else:
        typer.echo(f"run {run}: resume sent; its dispatcher sends tasks again unless an alert stopped the run")
