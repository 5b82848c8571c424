"""`rollstream bench rollout`'s pure part: phase 2's requests from phase 1's trajectories, the timed
window of phase 1, the env worker's catch-up rule, and the figures of each row (plain data in and out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from env_workers.engines import turn_seed
from schemas.arrays import unpack_ids

MB = 1024 * 1024
BACKLOG = 4
"""Default tasks per agent loop of phase 1. A run's env worker always has tasks waiting (the dispatcher keeps
`mix.max_in_flight_groups` groups out), so a loop that ends takes the next task; with as many tasks as loops
the engine's batch would empty as the short trajectories end and the long ones run on alone, which is the
workload's tail, not the loop's cost (the fleet's own bench: bench pipeline)."""


@dataclass(frozen=True)
class TurnRequest:
    """One engine-alone request standing for one turn of phase 1."""

    prompt: list[int]
    count: int
    """Tokens the turn generated: the request asks for exactly that many (ignore_eos)."""
    seed: int | None
    """The seed the env worker sent for that turn (None when it samples unseeded), so both phases pay
    the same sampling cost."""


def uncached(prompt: Sequence[int], replacement: int) -> list[int]:
    """`prompt` with its first token replaced by `replacement` (or `replacement + 1` where it already is that),
    so no prefix cached from the loop's own prompt serves it."""
    return [replacement if prompt[0] != replacement else replacement + 1, *prompt[1:]]


def turn_requests(trajectories: Sequence[Mapping[str, Any]], replacement: int, seeded: bool) -> list[TurnRequest]:
    """A request per turn: that turn's prompt with its first token replaced by `replacement` (or
    `replacement + 1` where it already is that), so the prefix cache phase 1 warmed cannot serve it
    while the requests still share prefixes among themselves as the loop's prompts do."""
    requests = []
    for trajectory in trajectories:
        ids = unpack_ids(trajectory["input_ids"]).tolist()
        for turn in trajectory["turns"]:
            prompt = ids[:turn["start"]]
            seed = turn_seed(trajectory["trajectory_id"], len(prompt)) if seeded else None
            requests.append(TurnRequest(uncached(prompt, replacement), turn["length"], seed))
    return requests


@dataclass(frozen=True)
class Chain:
    """One trajectory of phase 1 as phase 3 replays it: its first prompt, then per turn the tokens to
    generate, the seed, and the environment's tokens phase 1 appended after that turn. Each next prompt is
    the previous prompt, what the engine generated for it and those environment tokens, so the prefix
    cache holds all of it but the environment's tokens, as it does for the loop."""

    trajectory_id: str
    prompt: list[int]
    counts: list[int]
    seeds: list[int | None]
    following: list[list[int]]


def chains(trajectories: Sequence[Mapping[str, Any]], replacement: int, seeded: bool) -> list[Chain]:
    """A Chain per trajectory, in the order phase 1 started them, the first prompt's first token replaced
    as in turn_requests. Seeds are the worker's for the same prompt lengths."""
    out = []
    for trajectory in sorted(trajectories, key=lambda t: t["started_at_ms"]):
        ids = unpack_ids(trajectory["input_ids"]).tolist()
        turns = trajectory["turns"]
        if not turns:
            continue
        prompt = uncached(ids[:turns[0]["start"]], replacement)
        ends = [turn["start"] + turn["length"] for turn in turns]
        nexts = [turn["start"] for turn in turns[1:]] + [ends[-1]]
        tid = trajectory["trajectory_id"]
        out.append(Chain(tid, prompt, [turn["length"] for turn in turns],
                         [turn_seed(tid, turn["start"]) if seeded else None for turn in turns],
                         [ids[end:following] for end, following in zip(ends, nexts, strict=True)]))
    return out


def task_count(requested: int | None, concurrency: int, split_sizes: Sequence[int]) -> int:
    """Tasks of phase 1: `requested`, or BACKLOG per agent loop, within the mix's distinct tasks (the mix
    alternates its splits, so it holds len(split_sizes) x the smallest split); ValueError in one line when
    `requested` asks for more."""
    available = len(split_sizes) * min(split_sizes)
    if requested is None:
        return min(BACKLOG * concurrency, available)
    if requested > available:
        raise ValueError(f"--trajectories {requested} is more than the {available} distinct tasks of the mix "
                         f"(splits of {', '.join(map(str, split_sizes))} samples, alternating)")
    return requested


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


def metric_totals(text: str) -> dict[str, float]:
    """Each sample of a Prometheus text exposition summed over its labels (histogram buckets left out)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def engine_phase(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> dict[str, Any]:
    """What vLLM's own counters say of one phase: its scheduler steps, the requests it held on average
    (request time inside the engine over the wall time; requests between turns, in HTTP or in the loop
    are not inside), milliseconds per step, and prompt tokens computed rather than found in the prefix
    cache. None for a counter this vLLM does not export."""

    def delta(name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    steps = delta("vllm:iteration_tokens_total_count")
    inside = delta("vllm:request_inference_time_seconds_sum")
    prompt, cached = delta("vllm:prompt_tokens_total"), delta("vllm:prompt_tokens_cached_total")
    return {"steps": steps, "ms_per_step": 1000 * seconds / steps if steps else None,
            "mean_requests_inside": inside / seconds if inside is not None and seconds > 0 else None,
            "prompt_tokens_computed": prompt - cached if prompt is not None and cached is not None else None}


def cpu_phase(before: Mapping[str, float | None], after: Mapping[str, float | None], seconds: float,
              tokens: int, cores: int) -> dict[str, Any]:
    """CPU seconds of each party over one phase (CpuMeter samples), per generated token in milliseconds,
    and the share of the machine's cores that was busy. None where a party was not measured."""

    def delta(name: str) -> float | None:
        a, b = after.get(name), before.get(name)
        return a - b if a is not None and b is not None else None

    row: dict[str, Any] = {f"{name}_cpu_s": delta(name) for name in ("loop", "engine", "broker")}
    row["loop_thread_wait_s"] = delta("loop_thread_wait")
    for name in ("loop", "engine", "broker"):
        value = row[f"{name}_cpu_s"]
        row[f"{name}_ms_per_token"] = 1000 * value / tokens if value is not None and tokens else None
    machine = delta("machine")
    row["machine_busy_share"] = machine / (seconds * cores) if machine is not None and seconds > 0 else None
    return row


def time_per_turn(trajectories: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean milliseconds per turn of phase 1 in the engine call (`generate_ms`: HTTP and the engine's
    queue included), in the environment (`env_ms`) and in the rest of the loop (the trajectory's wall time
    less those two: encoding, parsing, publishing, waiting for the event loop)."""
    turns = generate = env = wall = 0.0
    for trajectory in trajectories:
        turns += len(trajectory["turns"])
        generate += sum(turn["generate_ms"] for turn in trajectory["turns"])
        env += sum(turn["env_ms"] for turn in trajectory["turns"])
        wall += trajectory["finished_at_ms"] - trajectory["started_at_ms"]
    if not turns:
        return {"generate_ms": 0.0, "environment_ms": 0.0, "loop_ms": 0.0}
    return {"generate_ms": generate / turns, "environment_ms": env / turns, "loop_ms": (wall - generate - env) / turns}
