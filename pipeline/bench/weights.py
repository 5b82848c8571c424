"""`rollstream bench weights`: what a delta version costs to stage and to load, against full versions
and against the machine's own copy speed.

For each learning rate (1e-6, AgentRL's, and 1e-4) the learner's real step (learner/step.py
train_step on synthetic agent batches, reference model and AdamW included) runs `--steps` times from
the same initial weights; after each step the learner's VersionStager stages the version in MinIO in
each dtype (bfloat16, as GPU engines serve; float32, as CPU engines do): version 0 a full snapshot,
then deltas (learner/delta.py). Per version: bytes staged (delta) beside the full version's bytes,
and the staging time. Then a late joiner (an empty engine directory, pipeline/engine/updates.py)
rebuilds the newest version through the whole chain and its tensors' sha256 are compared with the
learner's: `bit_identical`.

With the engine (default on), a real `rollstream engine` serving the model follows the bfloat16,
lr 1e-6 run: each delta version's `weights` event is sent in turn and timed until the engine
serves it (its state's version), the first one from the snapshot (it holds none of the chain), the
others on the version it holds. The baseline moves the full version's bytes as the machine can:
one contiguous, warmed buffer copied in memory, written to a file (fsync) and read back (page
cache dropped), best of several. `ratio` = delta update bandwidth / baseline bandwidth, both in
full-version bytes per second (pipeline/bench/weights_logic.py).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from learner.manifest import read_version, tensor_sha256
from learner.publish import VersionStager, prune_versions, served_tensors, tied_aliases, weight_version_event, without_aliases
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.bench.baselines import copy_baseline
from pipeline.bench.learner import synthetic_batch
from pipeline.bench.rollout import RANDOM_LARGE, engine_for, random_large_checkpoint
from pipeline.bench.weights_logic import engine_split, setting_summary, update_summary, version_row
from pipeline.engine.updates import EngineControl, download_version
from pipeline.policy.model_init import PolicyModelSettings, init_model
from pipeline.run.config import load_config
from schemas import objectstore, topics
from schemas.settings import ObjectStoreSettings
from schemas.bus import EventProducer, now_ms

LEARNING_RATES = (1e-6, 1e-4)
DTYPES = ("bfloat16", "float32")
ENGINE_SETTING = ("bfloat16", 1e-6)  # the one the engine follows: AgentRL's lr, a GPU engine's dtype
SEQUENCES = 4  # trajectories per synthetic batch: a real step, kept small for two CPU cores


def _fail(message: str) -> None:
    typer.echo(f"rollstream bench weights: {message}", err=True)
    raise typer.Exit(code=2)


def _late_join(mc, event: dict[str, Any], expected: dict[str, str], work: Path) -> dict[str, Any]:
    """An engine holding nothing rebuilds `event`'s version; bit_identical compares every tensor's sha256
    with the learner's (`expected`, by tensor name)."""
    directory = work / f"late-{uuid.uuid4().hex[:8]}" / f"v{event['version']:06d}"
    started = time.perf_counter()
    download_version(mc, event, directory)
    seconds = time.perf_counter() - started
    _, tensors = read_version(directory)
    identical = list(tensors) == list(expected) and all(tensor_sha256(tensors[n]) == h for n, h in expected.items())
    return {"version": event["version"], "chain_length": event["version"] + 1, "seconds": round(seconds, 3),
            "bit_identical": identical}


def _learner_phase(mc, model_dir: Path, prefix: str, steps: int, runs: list[str], work: Path, say
                   ) -> tuple[list[dict[str, Any]], tuple[list[dict[str, Any]], int] | None]:
    """Per (dtype, lr): the versions staged after each real learner step and the late joiner's rebuild;
    and the events (with the full version's bytes) the engine follows. A function of its own so that
    everything the learner held (policy, reference, AdamW, the stagers' previous versions: ~17 GB at
    0.5B) is freed before an engine starts beside this process (the first 0.5B run was killed for memory)."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config_dict = json.loads(policy.config.to_json_string())
    aliases = tied_aliases(policy)
    items = synthetic_batch(SEQUENCES, policy.config.vocab_size, np.random.default_rng(0))
    settings: list[dict[str, Any]] = []
    followed: tuple[list[dict[str, Any]], int] | None = None
    for lr in LEARNING_RATES:
        # Every setting starts from the checkpoint's weights, read again rather than kept: at 0.5B
        # a held copy is 2 GB of the ~20 GB the learner side needs (it was killed for memory).
        policy.load_state_dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict())
        ref = copy.deepcopy(policy).requires_grad_(False).eval()
        learner_settings = LearnerSettings(lr=lr, snapshot_interval=steps + 1)
        optimizer = make_optimizer(policy, learner_settings)
        stagers = {d: VersionStager(mc, f"{prefix}-{d}-{lr:g}", snapshot_interval=steps + 1,
                                    max_shard_bytes=learner_settings.max_shard_bytes,
                                    zstd_level=learner_settings.delta_zstd_level) for d in DTYPES}
        runs.extend(s.run for s in stagers.values())
        rows: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
        events: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
        last: dict[str, dict[str, str]] = {}  # the newest version's sha256 per tensor, per dtype
        for version in range(steps + 1):
            if version:
                metrics = train_step(policy, ref, optimizer, items, learner_settings)
                say(f"lr {lr:g}: step {version}, {metrics['timing/actor_s']:.1f} s")
            weights = without_aliases(policy.state_dict(), aliases)
            for dtype in DTYPES:
                tensors = served_tensors(weights, dtype)
                started = time.perf_counter()
                staged = stagers[dtype].stage(tensors, version=version, step=version, config=config_dict)
                stage_s = time.perf_counter() - started
                size = sum(s.size_bytes for s in staged.manifest.shards)
                full = rows[dtype][0]["staged_bytes"] if rows[dtype] else size
                rows[dtype].append(version_row(version, staged.manifest.kind, size, full, stage_s))
                events[dtype].append(weight_version_event(staged, batch_id=None, broadcast_pools=[],
                                                          published_at_ms=now_ms()))
                last[dtype] = {k: tensor_sha256(v) for k, v in tensors.items()}
                del tensors
        for dtype in DTYPES:
            late = _late_join(mc, events[dtype][-1], last[dtype], work)
            say(f"{dtype}, lr {lr:g}: late joiner rebuilt version {late['version']} in {late['seconds']} s, "
                f"bit identical: {late['bit_identical']}")
            settings.append(setting_summary(dtype, lr, rows[dtype], late))
            say(f"{dtype}, lr {lr:g}: delta_fraction {settings[-1]['delta_fraction']:.4f}")
            if (dtype, lr) == ENGINE_SETTING:
                followed = (events[dtype], rows[dtype][0]["full_bytes"])
        del ref, optimizer
    return settings, followed


def _learner_phase_apart(store: ObjectStoreSettings, model: str | None, model_dir: Path, prefix: str, steps: int,
                         work: Path) -> tuple[list[dict[str, Any]], tuple[list[dict[str, Any]], int] | None]:
    """The checkpoint (when made here) and the learner phase, in a process of their own: freed tensors stay in
    the allocator's arenas, and at 0.5B the bench process still held 14 GB when its engine started and
    was killed for memory (2026-12-03). Returns the phase's results."""
    say = Console(stderr=True).print
    torch.manual_seed(0)
    if model == RANDOM_LARGE:
        say(f"writing a random {RANDOM_LARGE} checkpoint")
        random_large_checkpoint(model_dir)
    elif model is None:
        init_model(PolicyModelSettings(), model_dir)
    return _learner_phase(objectstore.client(store), model_dir, prefix, steps, [], work, say)


def bench_weights(
    model: str | None = typer.Option(None, "--model", help=f"Checkpoint directory, or {RANDOM_LARGE} (Qwen2.5-0.5B's "
                                     "shape, random weights; ~20 GB of memory and ~40 minutes on two CPU cores); default: a fresh `model init`."),
    steps: int = typer.Option(10, "--steps", help="Learner steps (delta versions) per setting."),
    engine: bool = typer.Option(True, "--engine/--no-engine", help="Time event -> served on a real engine."),
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file (Kafka and MinIO)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Bytes staged per version, full against delta, for bfloat16 and float32 at lr 1e-6 and 1e-4 (a real
    learner step between versions); a late joiner's rebuild of the newest version, checked bit for bit;
    and the time from a delta's `weights` event to a real engine serving it, beside a memory copy plus a
    file write and read of the full version's bytes (`ratio`: bandwidth / baseline bandwidth).

    Example: rollstream bench weights --model random-0.5b --steps 10 --json
    """
    if steps < 1:
        _fail("--steps must be at least 1")
    if model not in (None, RANDOM_LARGE) and not (Path(model) / "config.json").is_file():
        _fail(f"{model} is not a checkpoint directory (no config.json)")
    cfg = load_config(config)
    err = Console(stderr=True)
    say = err.print
    mc = objectstore.client(cfg.object_store)
    objectstore.ensure_buckets(mc, [topics.WEIGHTS_BUCKET])
    prefix = f"bench-weights-{uuid.uuid4().hex[:8]}"
    runs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-weights-") as tmp:
        work = Path(tmp)
        model_dir = work / RANDOM_LARGE if model == RANDOM_LARGE else work / "policy" if model is None else Path(model)
        # the runs' prefix is known before the phase: whatever it staged is pruned even if it dies
        runs.extend(f"{prefix}-{d}-{lr:g}" for lr in LEARNING_RATES for d in DTYPES)
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as apart:
                settings, followed = apart.submit(_learner_phase_apart, cfg.object_store, model, model_dir,
                                                  prefix, steps, work).result()
            update = None
            if engine and followed is not None:
                update = _engine_updates(cfg, model_dir, followed[0], followed[1], work, say)
        finally:
            for run in runs:
                prune_versions(mc, run, keep=set())
    report = {"model": str(model or "model init"), "steps": steps, "settings": settings, "update": update,
              "ratio": update["ratio"] if update else None}
    if as_json:
        typer.echo(json.dumps(report))
        return
    _print(report)


def _engine_updates(cfg, model_dir: Path, events: list[dict[str, Any]], full_bytes: int, work: Path,
                    say) -> dict[str, Any]:
    """Sends each delta version's event to a real engine following the run, timing event -> served."""
    run = events[0]["run"]
    base = copy_baseline(full_bytes)
    say(f"baseline for {full_bytes / 2**20:.0f} MB: {base['seconds']:.3f} s "
        f"(copy {base['memory_copy_s']:.3f}, write {base['file_write_s']:.3f}, read {base['file_read_s']:.3f})")
    served: list[float] = []
    with engine_for(model_dir, run, work / "engines", 1024) as server, \
            EventProducer(cfg.kafka, client_id=f"bench-weights-{run}") as producer:
        control = EngineControl(server.url)
        for event in events[1:]:
            started = time.perf_counter()
            producer.send(topics.WEIGHTS, event, key=run)
            producer.flush()
            deadline = time.monotonic() + 600
            while control.state()["version"] != event["version"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not serve version {event['version']}:\n{server.log_tail()}")
                time.sleep(0.01)
            served.append(time.perf_counter() - started)
            say(f"engine serves version {event['version']} {served[-1]:.2f} s after its event")
    split = engine_split(server.log_path.read_text(errors="replace"))  # read once the engine stopped: all of it
    for row in split:
        say(f"engine applied version {row['version']} in memory: download {row['download_s']:.2f} s, drain "
            f"{row['drain_s']:.2f} s, apply {row['apply_s']:.2f} s, load {row['load_s']:.2f} s")
    # The first delta is rebuilt from the snapshot (the engine held none of the chain): reported, not in the median.
    summary = update_summary(full_bytes, served[1:] or served, base)
    return {**summary, "first_s": served[0], "baseline": base, "engine_split": split}


def _print(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"bench weights ({report['model']}, {report['steps']} steps)")
    for column in ("dtype", "lr", "full MB", "delta fraction (mean)", "max", "late joiner", "bit identical"):
        table.add_column(column)
    for s in report["settings"]:
        table.add_row(s["dtype"], f"{s['lr']:g}", f"{s['versions'][0]['full_bytes'] / 2**20:.1f}",
                      f"{s['delta_fraction']:.4f}", f"{s['delta_fraction_max']:.4f}", f"{s['late_join']['seconds']} s",
                      str(s["late_join"]["bit_identical"]))
    console.print(table)
    if report["update"]:
        u = report["update"]
        console.print(f"event -> served (median of {u['versions']}): {u['median_s']:.3f} s "
                      f"({u['mb_per_s']:.0f} MB/s of the full version); baseline {u['baseline']['seconds']:.3f} s "
                      f"({u['baseline']['mb_per_s']:.0f} MB/s); ratio {u['ratio']:.2f}; first (from the snapshot) "
                      f"{u['first_s']:.2f} s")
