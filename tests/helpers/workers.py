"""A real streams worker in a subprocess, and the synthetic load that drives it.

`WorkerProcess` (pipeline/run/streams_worker.py) runs `rollstream streams worker` as deployed;
`SyntheticRun` and `feed_windowed` (pipeline/run/synthetic_load.py) play the dispatcher, the env
workers and the learner around it. Both are library code that `rollstream bench streams` uses too.
"""

from __future__ import annotations

from pipeline.run.streams_worker import WorkerProcess
from pipeline.run.synthetic_load import GroupsDropped, SyntheticRun, feed_windowed

__all__ = ["GroupsDropped", "SyntheticRun", "WorkerProcess", "feed_windowed"]
