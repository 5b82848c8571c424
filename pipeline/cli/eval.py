"""`rollstream eval`: held-out success of one checkpoint, through the same pipeline as training.

An evaluation is a run of its own (`eval-<time>`): one current-pool engine serving the checkpoint,
the Faust router, the env workers, and the validation requests of every chosen family (each sample
`n` times) sent to `tasks.requested`. Its trajectories are durable events like any run's, so
`rollstream replay trajectories --run eval-…` gives them back. Printed: per task the success rate
as mean ± std over the n repeats (AgentRL Table 3) and the termination-status shares (Table 7).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from learner.manifest import ShardIntegrityError, read_version
from learner.publish import manifest_uri
from pipeline.analysis import evaluation
from pipeline.dispatch.logic import TaskSource, validation_requests
from pipeline.engine.launch import free_port
from pipeline.engine.updates import download_version
from pipeline.policy.sft import EVAL_SPLITS, WEIGHT_SUFFIXES
from pipeline.run.config import RollstreamConfig, load_config
from pipeline.run.live_view import RunView
from pipeline.run.plan import env_worker_children, streams_app_id, streams_child
from pipeline.run.up import (
    Interrupted,
    RunFailed,
    RunFollower,
    Stack,
    catch_interrupts,
    shut_down,
    start_engines,
    timestamped,
)
from schemas import objectstore, topics
from schemas.bus import EventProducer, now_ms
from streams.worker import start_at_end

STD = "std"  # each family's held-out split (pipeline/policy/sft.py EVAL_SPLITS)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"rollstream eval: {message}", err=True)
    raise typer.Exit(code=code)


class VersionUnavailable(RuntimeError):
    """A staged version that is damaged or no longer in the object store."""


def materialize_version(cfg: RollstreamConfig, run: str, version: int, base: Path, out: Path) -> Path:
    """A servable checkpoint of a run's staged version: `base`'s tokenizer and config, the version's weights.
    Raises VersionUnavailable when the object store has no intact copy of it."""
    event = {"manifest_uri": manifest_uri(run, version), "version": version, "shards": []}
    staged = out / "staged"
    try:
        download_version(objectstore.client(cfg.object_store), event, staged)
        _, tensors = read_version(staged)
    except ShardIntegrityError as error:
        raise VersionUnavailable(f"version {version} of run {run} is damaged: {error}") from None
    except Exception as error:  # the object store answers a missing (pruned) version with S3Error
        raise VersionUnavailable(f"version {version} of run {run} is not in the object store ({error}); the "
                                 f"learner keeps only the latest versions: use a checkpoint directory instead") from None
    model_dir = out / f"v{version:06d}"
    model_dir.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, model_dir / path.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(staged)
    return model_dir


def validation_sources(families: list[str], split: str, samples: int | dict[str, int] | None,
                       envs: EnvSettings | None = None) -> tuple[TaskSource, ...]:
    sources = []
    for family in families:
        chosen = EVAL_SPLITS.get(family, "") if split == STD else split
        try:
            if chosen not in registry.split_names(family):
                _fail(f"family {family!r} has no split {chosen!r}; splits: {', '.join(registry.split_names(family))}")
            count = len(registry.samples(family, chosen, envs or load_config().envs))
        except registry.UnknownFamily as error:
            _fail(str(error))
        cap = samples.get(family) if isinstance(samples, dict) else samples
        sources.append(TaskSource(task=family, split=chosen, count=min(count, cap) if cap else count))
    return tuple(sources)


def run_eval(cfg: RollstreamConfig, model_dir: Path, version: int, sources: tuple[TaskSource, ...], n: int,
             console: Console, timeout_s: float) -> dict:
    run = time.strftime("eval-%Y%m%d-%H%M%S")
    run_dir = cfg.run_dir(run)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    say = timestamped(console)

    stack = Stack(run_dir / "logs")
    follower = None
    previous = catch_interrupts()
    requests = validation_requests(run, sources, n, 0, version, now_ms())
    started = time.monotonic()
    try:
        start_engines(cfg, run, run_dir, model_dir, {"current": 1}, say, into=stack.engines)
        start_at_end(cfg.kafka, streams_app_id(run))
        follower = RunFollower(cfg.kafka, RunView(run), since_ms=now_ms() - 5000)
        follower.start()
        stack.start(streams_child(cfg, run, run_dir, free_port(), components=("router",)))
        for child in env_worker_children(cfg, run, run_dir, model_dir, {"current": [stack.engines[0].url]},
                                         cfg.envs):
            stack.start(child)
        with EventProducer(cfg.kafka, client_id=f"eval-{run}") as producer:
            for e in requests:
                producer.send(topics.TASKS_REQUESTED, e, key=e["group_id"])
        say(f"{len(requests)} validation rollouts requested ({len(sources)} families x samples x n={n})")
        shown = -1
        while True:
            time.sleep(2.0)
            with follower.lock:
                done = len(follower.view.validation_done.get(0, []))
                complete = follower.view.validation_complete(0)
            if done != shown:
                say(f"{done} / {len(requests)} trajectories")
                shown = done
            if complete:
                break
            dead = stack.failed()
            if dead is not None:
                raise RunFailed(f"{dead.child.name} exited with {dead.process.returncode}:\n{dead.log_tail()}")
            if time.monotonic() - started > timeout_s:
                raise RunFailed(f"only {done} of {len(requests)} trajectories after {timeout_s:.0f} s")
    finally:
        shut_down(stack, follower, previous, say)
    trajs = evaluation.dedup(follower.view.validation_done[0])
    return {"run": run, "version": version, "n": n, "episodes": len(trajs),
            "duration_s": round(time.monotonic() - started, 1),
            "success": evaluation.repeat_table(trajs), "termination": evaluation.termination_shares(trajs)}


def print_tables(result: dict, console: Console) -> None:
    success = Table(title=f"success, mean ± std over n = {result['n']}")
    for col in ("task", "episodes", "success"):
        success.add_column(col, justify="right")
    for task, row in result["success"].items():
        success.add_row(task, str(sum(row["episodes"])), f"{row['mean']:.1%} ± {row['std']:.1%}")
    console.print(success)
    shares = result["termination"]
    statuses = sorted({s for t in shares["tasks"].values() for s in t["shares"]})
    status_table = Table(title="termination status shares")
    status_table.add_column("task")
    for s in statuses:
        status_table.add_column(s.replace("_", " "), justify="right")
    for task, row in [*shares["tasks"].items(), ("overall", shares["overall"])]:
        status_table.add_row(task, *(f"{row['shares'].get(s, 0.0):.0%}" for s in statuses))
    console.print(status_table)


def eval_checkpoint(
    checkpoint: str = typer.Option(..., "--checkpoint", help="A checkpoint directory, or a VERSION of --run staged in MinIO."),
    run: str = typer.Option("", "--run", help="The training run whose VERSION to evaluate."),
    split: str = typer.Option(STD, "--split", help="'std' (each family's held-out split) or one split name for all."),
    n: int = typer.Option(4, "--n", min=1, help="Repeats of every sample (AgentRL: 4)."),
    families: str = typer.Option("", "--families", help="Comma-separated families (default: the configured validation families)."),
    samples: int | None = typer.Option(None, "--samples", min=1, help="Samples per family, the first ones (default: mix.val_samples)."),
    timeout_s: float = typer.Option(3600.0, "--timeout-s", help="Give up after this long."),
    config: Path | None = typer.Option(None, "--config", help="YAML run configuration (engines, env workers, limits)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Evaluate a checkpoint on held-out tasks through the pipeline (current pool only).

    Example: rollstream eval --checkpoint 20 --run run-20261129-120000 --split std --n 4 --config configs/cpu.yaml
    """
    cfg = load_config(config)
    console = Console(stderr=True)
    chosen = [f.strip() for f in families.split(",") if f.strip()] or [f.partition(":")[0] for f in cfg.mix.val_families]
    sources = validation_sources(chosen, split, samples or cfg.mix.val_samples, cfg.envs)
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        model_dir, version = path, 0
    elif checkpoint.isdigit():
        if not run:
            _fail("--checkpoint VERSION needs --run (the run that trained it)")
        base = cfg.policy_dir()
        if not (base / "config.json").is_file():
            _fail(f"the policy {base} (policy.path) is needed for the tokenizer and config of version {checkpoint}")
        version = int(checkpoint)
        out = cfg.run_dir(run) / "checkpoints"
        try:
            model_dir = materialize_version(cfg, run, version, base, out)
        except VersionUnavailable as error:
            _fail(str(error), 1)
    else:
        _fail(f"--checkpoint {checkpoint!r} is neither a checkpoint directory (with config.json) nor a version number")
    try:
        result = run_eval(cfg, model_dir, version, sources, n, console, timeout_s)
    except RunFailed as error:
        _fail(str(error), 1)
    except Interrupted:
        _fail("interrupted", 130)
    result["checkpoint"] = str(model_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_tables(result, Console())
