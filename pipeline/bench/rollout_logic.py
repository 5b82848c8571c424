"""`rollstream bench rollout`'s pure part: phase 2's requests from phase 1's trajectories, the timed
window of phase 1, the env worker's catch-up rule, and the figures of each row (plain data in and out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from env_workers.engines import turn_seed
from schemas.arrays import unpack_ids

MB = 1024 * 1024


@dataclass(frozen=True)
class TurnRequest:
    """One engine-alone request standing for one turn of phase 1."""

    prompt: list[int]
    count: int
    """Tokens the turn generated: the request asks for exactly that many (ignore_eos)."""
    seed: int | None
    """The seed the env worker sent for that turn (None when it samples unseeded), so both phases pay
    the same sampling cost."""


def turn_requests(trajectories: Sequence[Mapping[str, Any]], replacement: int, seeded: bool) -> list[TurnRequest]:
    """A request per turn: that turn's prompt with its first token replaced by `replacement` (or
    `replacement + 1` where it already is that), so the prefix cache phase 1 warmed cannot serve it
    while the requests still share prefixes among themselves as the loop's prompts do."""
    requests = []
    for trajectory in trajectories:
        ids = unpack_ids(trajectory["input_ids"]).tolist()
        for turn in trajectory["turns"]:
            prompt = ids[:turn["start"]]
            first = replacement if prompt[0] != replacement else replacement + 1
            seed = turn_seed(trajectory["trajectory_id"], len(prompt)) if seeded else None
            requests.append(TurnRequest([first, *prompt[1:]], turn["length"], seed))
    return requests


def loop_seconds(trajectories: Iterable[Mapping[str, Any]], acknowledged_at_s: float) -> float:
    """Phase 1's wall time: from the first rollout's start (the worker's own `started_at_ms`, so the
    consumer group's join is not counted) to the moment every event was acknowledged by the broker."""
    return acknowledged_at_s - min(t["started_at_ms"] for t in trajectories) / 1000.0


def caught_up(end_offsets: Mapping[int, int], committed: Mapping[int, int]) -> bool:
    """Whether a consumer group has committed past everything in the topic (the other runs' tasks a
    new group passes over), so tasks produced from now on are the only work it finds."""
    return all(committed.get(partition, -1) >= end for partition, end in end_offsets.items() if end > 0)


def throughput_row(name: str, trajectories: int, turns: int, tokens: int, seconds: float) -> dict[str, Any]:
    """One phase: counts, seconds, tokens/s and trajectories/s."""
    return {"name": name, "trajectories": trajectories, "turns": turns, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": tokens / seconds, "trajectories_per_s": trajectories / seconds}


def transfer(nbytes: int, seconds: float, **extra: Any) -> dict[str, Any]:
    """Bytes moved in `seconds`, and MB/s (MB = 2^20 bytes)."""
    return {"bytes": nbytes, "seconds": seconds, "mb_per_s": nbytes / MB / seconds, **extra}


def status_counts(trajectories: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Trajectories per final status."""
    counts: dict[str, int] = {}
    for trajectory in trajectories:
        counts[trajectory["status"]] = counts.get(trajectory["status"], 0) + 1
    return counts
