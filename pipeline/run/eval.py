"""An evaluation of one checkpoint, through the same pipeline as training (`rollstream eval`).

An evaluation is a run of its own (`eval-<time>`): one current-pool engine serving the checkpoint,
the Faust router, the env workers, and the validation requests of every chosen family (each sample
`n` times) sent to `tasks.requested`. Its trajectories are durable events like any run's, so
`rollstream replay trajectories --run eval-…` gives them back. The result: per task the success
rate as mean ± std over the n repeats (AgentRL Table 3) and the termination-status shares (Table 7).
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from pipeline.analysis import evaluation
from pipeline.dispatch.logic import TaskSource, validation_requests
from pipeline.engine.launch import free_port
from pipeline.policy.splits import EVAL_SPLITS
from pipeline.run.config import RollstreamConfig, load_config
from pipeline.run.live_view import RunView
from pipeline.run.plan import env_worker_children, streams_app_id, streams_child
from pipeline.run.up import (
    RunFailed,
    RunFollower,
    Stack,
    catch_interrupts,
    shut_down,
    start_engines,
    timestamped,
)
from schemas import topics
from schemas.bus import EventProducer, now_ms
from streams.worker import start_at_end

STD = "std"  # each family's held-out split (pipeline/policy/splits.py EVAL_SPLITS)


def validation_sources(families: list[str], split: str, samples: int | dict[str, int] | None,
                       envs: EnvSettings | None = None) -> tuple[TaskSource, ...]:
    """One source per family: its `split` (STD: its held-out split), at most `samples` of it (one cap, or
    one per family). Raises ValueError, in one line, for an unknown family or a split it lacks."""
    sources = []
    for family in families:
        chosen = EVAL_SPLITS.get(family, "") if split == STD else split
        try:
            if chosen not in registry.split_names(family):
                raise ValueError(f"family {family!r} has no split {chosen!r}; "
                                 f"splits: {', '.join(registry.split_names(family))}")
            count = len(registry.samples(family, chosen, envs or load_config().envs))
        except registry.UnknownFamily as error:
            raise ValueError(str(error)) from None
        cap = samples.get(family) if isinstance(samples, dict) else samples
        sources.append(TaskSource(task=family, split=chosen, count=min(count, cap) if cap else count))
    return tuple(sources)


def run_eval(cfg: RollstreamConfig, model_dir: Path, version: int, sources: tuple[TaskSource, ...], n: int,
             console: Console, timeout_s: float) -> dict:
    """Runs the evaluation as a run of its own and returns its result: per task the success over the
    `n` repeats and the termination-status shares. Raises RunFailed, or Interrupted on Ctrl-C."""
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
