"""A tiny policy made with the real `rollstream model init` (the default architecture at its smallest
width that vLLM's CPU kernels serve: head_dim 64), for tests that run engines and a learner on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.run.config import REPO_ROOT


def tiny_policy(out: Path, *, layers: int = 2) -> Path:
    """Makes the policy in `out` and returns it."""
    subprocess.run([sys.executable, "-m", "pipeline.cli", "model", "init", "--out", str(out), "--hidden", "128",
                    "--layers", str(layers), "--heads", "2", "--kv-heads", "1", "--intermediate", "256"],
                   cwd=REPO_ROOT, check=True, capture_output=True)
    return out
