"""The policy a run starts from: the configured checkpoint, made once (init, then SFT) when it is missing."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from pipeline.engine.launch import stop_process_group
from pipeline.policy.demonstrations import split_error
from pipeline.run.config import REPO_ROOT, RollstreamConfig, write_config
from pipeline.run.plan import rollstream
from pipeline.run.supervision import RunFailed


def ensure_policy(cfg: RollstreamConfig, log_dir: Path, say: Callable[[str], None]) -> Path:
    """The configured checkpoint; made as the default policy (init, then SFT) when it does not exist."""
    path = cfg.policy_dir()
    if (path / "config.json").is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise RunFailed(f"{path} is neither empty nor a checkpoint (no config.json): move it or set policy.path")
    problem = split_error(cfg.policy.sft_splits)
    if problem:  # before `model init`, which takes a while
        raise RunFailed(f"policy.sft_splits: {problem}")
    base = path.with_name(path.name + ".init")
    say(f"no policy at {path}: making the default policy (model init + model sft; several minutes, once)")
    # No evaluation inside `model sft`: the run's validation round 0 measures the same policy.
    # SFT demonstrates the run's own tasks (its `envs`: e.g. the calc difficulty), read from a copy of the run's config.
    config = log_dir.parent / "settings" / "policy-config.json"
    write_config(cfg, config)
    steps = [rollstream("model", "init", "--out", str(base), "--force"),
             rollstream("model", "sft", "--model", str(base), "--out", str(path), "--force", "--eval-episodes", "0",
                        "--config", str(config), *sft_arguments(cfg))]
    for argv in steps:
        code = _run_step(argv, log_dir / "policy.log")
        if code != 0:
            raise RunFailed(f"making the default policy failed ({' '.join(argv[2:5])}): see {log_dir / 'policy.log'}")
    return path


def sft_arguments(cfg: RollstreamConfig) -> tuple[str, ...]:
    """`model sft`'s options for the configuration's policy.sft_splits and sft_samples; none when they are empty."""
    splits, samples = cfg.policy.sft_splits, cfg.policy.sft_samples
    if not splits:
        return ()
    return ("--families", ",".join(splits), "--samples", ",".join(f"{name}={samples[name]}" for name in splits),
            *(argument for name, split in splits.items() for argument in ("--split", f"{name}={split}")))


def _run_step(argv: tuple[str, ...], log_path: Path) -> int:
    """Runs one command to its end, its stdout appended to `log_path`; its exit status."""
    # Progress bars of these commands go straight to our stderr: nothing else is on screen yet.
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM while the policy is made: it stops too
            stop_process_group(proc, timeout_s=30)
            raise
