"""A real vLLM CPU engine for a test: `rollstream engine` launched, waited for and stopped the way
`rollstream up` does it (pipeline/engine/launch.py: `launch_engine`, `wait_until_serving`,
`stop`), so a test serves through the same code path and the same health poll as a run."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.engine.launch import EngineProcess, launch_engine
from pipeline.run.config import REPO_ROOT


@contextmanager
def serving_engine(model_dir: Path, work_dir: Path, *, pool: str = "current", run: str | None = None,
                   engine_id: str | None = None, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                   start_timeout_s: float = 600.0, stop_timeout_s: float = 60.0) -> Iterator[tuple[EngineProcess, float]]:
    """An engine serving `model_dir`, with its supervisor's log in `work_dir`; yields it and the seconds
    it took to serve. `args` go to `rollstream engine` (e.g. `--max-model-len`), `env` replaces the
    environment it inherits; `run` is the run whose `weights` it follows (default: one of its own, so
    that no other test's versions reach it). The start timeout is a run's default (engines.start_timeout_s):
    on a loaded machine a start takes minutes, and an engine that fails exits long before. Stopped on
    leaving, also when it never came up."""
    engine = launch_engine(pool=pool, model_dir=model_dir, run=run or f"test-{uuid.uuid4().hex[:8]}",
                           work_dir=work_dir, engine_id=engine_id, extra_args=args, cwd=REPO_ROOT, env=env)
    try:
        start_s = engine.wait_until_serving(start_timeout_s)
        print(f"\nengine {engine.engine_id} serving after {start_s:.1f} s", file=sys.stderr)
        yield engine, start_s
    finally:
        engine.stop(stop_timeout_s)
