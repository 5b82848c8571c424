"""`rollstream study`: one configuration run under N seeds and several variants, side by side.

For each seed, for each variant, one `rollstream up` run with the variant's overrides and the seed
(run id `<study>-<variant>-s<seed>`), each a subprocess of its own: a run that crashes is recorded
(variant, seed, error) and the study goes on. Then `runs/<study>/study.json` and `study.png`
(pipeline/analysis/study.py): per variant and family, how many seeds improved outside the noise and
the mean change. study.json is rewritten after every run, so a study stopped half-way keeps what it
measured.

What a seed changes (the configuration's `seed`): the dispatcher's sample order, the engines'
per-request sampling seeds and the learner's torch RNG. The starting policy is shared by every
seed and variant: `up` makes it once when it does not exist, and remaking it per seed (`model init`
+ `model sft`) would cost more than the runs themselves. Every variant runs on the same seeds, so
the variants are compared on the same task orders and, where their prompts and weights agree (the
validation round before training), on the same samples.

The variants are the AgentRL paper's ablations, the batch construction options of other papers
(RAGEN, ERPO, ScalingInter-RL, ...), policy loss options (MiniMax-M1, AReaL, IcePop, ROLL) and SAO
(seed 000 §7.1: group size 1 with the learner's critic), as configuration overrides in one table
(VARIANTS).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.analysis.study import plot_study, study_document
from pipeline.run.config import (
    REPO_ROOT,
    ConfigError,
    RollstreamConfig,
    validation_message,
    write_config,
)
from pipeline.run.plan import rollstream

VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "no-task-norm": {"streams": {"task_adv_norm": False}},  # GRPO advantages only
    "no-cross": {"streams": {"stale_ratio": 0.0}},  # no cross-policy sampling (the stale engines idle)
    "trajectory-mix": {"streams": {"routing_mode": "trajectory"}},  # one pool per trajectory, not per turn
    # batch construction options (ARCHITECTURE.md "Batch construction options"); the values are for
    # configs/cpu.yaml (24 steps, max_turns 6) where the paper's own do not fit
    "variance-filter": {"streams": {"variance_filter_keep": 0.25}},  # RAGEN's config/base.yaml: top 25% by reward std
    "erpo-norm": {"streams": {"adv_norm": "erpo", "task_adv_norm": False}},  # group mean, environment std
    "fifo-window": {"streams": {"fifo_window_s": 300.0}},  # rollstream's pick: groups at most 5 minutes old
    "positive-first": {"streams": {"positive_only_steps": 8}},  # max(A, 0) for the first third of 24 steps
    # ScalingInter-RL's 8 -> 12 -> 15 of 15 turns, scaled to 6 turns, raised at thirds of 24 steps
    "turn-schedule": {"streams": {"turn_schedule": ((0, 3), (8, 5), (16, 6))}},
    # policy loss options (ARCHITECTURE.md "Policy loss options"), each with the learner's is_cap 2
    "cispo": {"learner": {"policy_loss": "cispo"}},  # MiniMax-M1: clipped stop-gradient weight on A * log pi
    "decoupled-tis": {"learner": {"policy_loss": "decoupled", "is_correction": "tis"}},  # AReaL + weight min(rho, 2)
    "icepop": {"learner": {"is_correction": "icepop"}},  # tokens whose rho leaves [0.5, 2] masked
    "ipa": {"learner": {"is_level": "chunk"}},  # ROLL's IPA: ratios per assistant turn
    # three PPO updates per batch (learner.updates_per_batch): a 6-group batch as three mini-batches of two groups
    "updates-3": {"learner": {"updates_per_batch": 3}},
    # SAO (seed 000 §7.1, ARCHITECTURE.md "SAO"): one sample per task, the learner's critic and skip-observation
    # GAE, DIS-gated actor. 48 single-trajectory groups per batch: the trajectories configs/cpu.yaml's 6 groups of
    # 8 give; critic_lr for its 256-wide policy over 24 steps (verl's 1e-5 barely moves a linear head that narrow)
    "sao": {"streams": {"group_size": 1, "min_members": 1, "advantage": "none", "batch_size": 48},
            "learner": {"advantage_estimator": "sao", "critic_lr": 1e-3}},
    # arithmetic (schemas/precision.py): the engines and the learner in one dtype, whatever the configuration says
    "float32": {"engines": {"dtype": "float32"}, "learner": {"compute_dtype": "float32"}},
    "bfloat16": {"engines": {"dtype": "bfloat16"}, "learner": {"compute_dtype": "bfloat16"}},
}
"""Variant name -> the configuration overrides it runs with (nested as in the YAML file)."""

INTERRUPTED_EXIT = 130  # what `rollstream up` exits with after Ctrl-C


class StudyExists(ValueError):
    """The study's folder already holds a study.json: its run ids are taken (a run id starts one run)."""


def parse_variants(text: str) -> tuple[str, ...]:
    """"base,no-cross" -> the variants in that order, each once; ConfigError naming an unknown one."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant {', '.join(unknown)}; variants: {', '.join(VARIANTS)}")
    if not names:
        raise ConfigError(f"no variant given; variants: {', '.join(VARIANTS)}")
    return names


def run_id(study: str, variant: str, seed: int) -> str:
    return f"{study}-{variant}-s{seed}"


def _paths(overrides: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in overrides.items():
        out += _paths(value, (*prefix, key)) if isinstance(value, Mapping) else [(*prefix, key)]
    return out


def env_conflicts(variants: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """ROLLSTREAM_ variables that would override what the study sets (the seed, a variant's fields):
    the environment wins over a configuration file, so a run would silently not be what it says."""
    names = {"ROLLSTREAM_SEED"}
    for variant in variants:
        for path in _paths(VARIANTS[variant]):
            names |= {"ROLLSTREAM_" + "__".join(path[:i]).upper() for i in range(1, len(path) + 1)}
    return sorted(k for k in environ if k.upper() in names)


def _merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


def variant_config(cfg: RollstreamConfig, variant: str, seed: int) -> RollstreamConfig:
    """`cfg` with the variant's overrides and the seed, validated again; ConfigError when they do not fit."""
    data = _merged(cfg.as_data(), {**VARIANTS[variant], "seed": seed})
    try:
        return RollstreamConfig(**data)
    except ValidationError as error:
        raise ConfigError(f"variant {variant}, seed {seed}: {validation_message(error)}") from None


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[-50:] if line.strip()]
    return lines[-1] if lines else "no output"


def run_one(cfg: RollstreamConfig, run: str, study_dir: Path) -> tuple[dict[str, Any], bool]:
    """One `rollstream up` subprocess for `cfg` as run `run`; (its record, whether it was interrupted).
    Its progress goes to <study>/logs/<run>.log; it is told the configuration through a file."""
    config_path = study_dir / "configs" / f"{run}.json"
    write_config(cfg, config_path)
    log_path = study_dir / "logs" / f"{run}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = rollstream("up", "--config", str(config_path), "--run", run, "--json", "--no-live")
    started = time.monotonic()
    interrupted = False
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            out, _ = proc.communicate()
        except KeyboardInterrupt:  # the run got the same Ctrl-C: let it stop its processes
            out, _ = proc.communicate()
            interrupted = True
    record: dict[str, Any] = {"run": run, "duration_s": round(time.monotonic() - started, 1)}
    interrupted = interrupted or proc.returncode == INTERRUPTED_EXIT
    try:
        record["outcome"] = json.loads(out)["outcome"] if out.strip() else None
    except (ValueError, KeyError, TypeError):
        record["outcome"] = None
    summary_path = cfg.run_dir(run) / "summary.json"
    if proc.returncode != 0:
        record["error"] = f"exit {proc.returncode}: {_last_line(log_path)} (log {log_path})"
    elif not summary_path.is_file():
        record["error"] = f"no report (summary.json): {_last_line(log_path)} (log {log_path})"
    else:
        record["summary"] = json.loads(summary_path.read_text())
    return record, interrupted


def run_study(cfg: RollstreamConfig, study: str, seeds: int, variants: Sequence[str], *, first_seed: int = 0,
              config_path: Path | None = None, say: Callable[[str], None] = lambda line: None,
              run: Callable[[RollstreamConfig, str, Path], tuple[dict[str, Any], bool]] = run_one) -> dict[str, Any]:
    """Runs every (seed, variant) of the study, seed by seed (seeds first_seed..first_seed+seeds-1), and
    writes runs/<study>/study.json and study.png; returns study.json's content. Raises ConfigError for a
    variant that does not validate, a negative first seed or an environment variable that would override
    the study, StudyExists for a study already run.
    `run` runs one (a test may pass its own)."""
    conflicts = env_conflicts(variants, os.environ)
    if conflicts:
        raise ConfigError(f"unset {', '.join(conflicts)}: the study sets these itself")
    if first_seed < 0:
        raise ConfigError(f"first seed {first_seed}: a seed is 0 or more")
    seed_range = range(first_seed, first_seed + seeds)
    plan = [(seed, variant, variant_config(cfg, variant, seed)) for seed in seed_range for variant in variants]
    study_dir = cfg.run_dir(study)
    if (study_dir / "study.json").exists():
        raise StudyExists(f"study {study} exists ({study_dir / 'study.json'}); choose another --study")
    study_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    overrides = {v: VARIANTS[v] for v in variants}
    interrupted = False
    _write(study_dir, study_document(study, _name(config_path), seed_range, overrides, records))  # claims the ids
    for i, (seed, variant, run_cfg) in enumerate(plan, 1):
        rid = run_id(study, variant, seed)
        say(f"study {study}: run {i}/{len(plan)} {rid} (variant {variant}, seed {seed})")
        record, interrupted = run(run_cfg, rid, study_dir)
        records.append({"variant": variant, "seed": seed, **record})
        say(f"study {study}: {rid} " + (f"failed: {record['error']}" if record.get("error")
                                         else f"{record.get('outcome')} in {record['duration_s']:.0f} s"))
        _write(study_dir, study_document(study, _name(config_path), seed_range, overrides, records,
                                         interrupted=interrupted))
        if interrupted:
            say(f"study {study}: interrupted after {i} of {len(plan)} runs")
            break
    document = study_document(study, _name(config_path), seed_range, overrides, records, interrupted=interrupted)
    if plot_study(document["results"], study_dir / "study.png"):
        document["figure"] = "study.png"
    _write(study_dir, document)
    return {**document, "folder": str(study_dir)}


def _name(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _write(study_dir: Path, document: Mapping[str, Any]) -> None:
    tmp = study_dir / "study.json.tmp"
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    tmp.replace(study_dir / "study.json")  # never half a file, also when the study is stopped mid-write
