"""`rollstream bench chaos`, the pure part: which faults go in when, at which moment of the run, one or
two at once, and what the run lost.

A chaos run is `bench faults` past the one-fault-at-a-time table: for a fixed time, a seeded random
schedule draws the next fault from a shuffled deck of every kind (each kind as often as the others),
sometimes a second one with it (two faults at once, on different targets), after a random pause.
Some faults wait for the moment they are about (`MOMENTS`): the learner killed while it stages and
checkpoints a step it has trained but not announced, the object store restarted then too (a
checkpoint write), an engine killed or hung while a new version reaches it (a weight update), the
stream processor killed as it cuts a batch. A fault whose moment does not come within
`moment_wait_s` goes in anyway, recorded as such. Faults that last (an engine stopped with SIGSTOP,
a slow env worker, the broker's disk nearly full) are lifted after their `hold_s`.

An episode (one fault or two) has recovered when what each fault hit is back and lifted, every poison
event sits in `dlq`, and the learner has trained work dispatched after the fault was lifted: it has
published `drain_versions` versions past the one it was at when the fault was lifted (a lasting fault's
lift: when first observed). With at most
`in_flight_bound` groups dispatched and untrained and `batch_size` groups a batch, the groups
dispatched before the lift fill at most bound / batch_size batches, so the next one holds new work;
one version past the fault is not enough (a broker restart once left the dispatcher reading nothing,
and the learner still trained a batch of what was already in flight). When the time is
up, the episode in flight may still recover; one that does not within `recovery_limit_s` counts as a
loss.

The figures: per fault kind its count, recovery times and work redone; for the run, the losses
(unrecovered episodes, poison missing from `dlq`, what `replay verify` finds lost), the batches and the
trajectories trained twice, and `ratio` = losses + double-trained (0 when all is well). Findings are
restarts no fault asked for (faults_logic.findings), reported beside it.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.bench.faults_logic import LOSS_CHECKS

ANY, WEIGHT_UPDATE, CHECKPOINT, BATCH_CUT = "any", "weight_update", "checkpoint", "batch_cut"
MOMENTS = {
    ANY: "whenever it is due",
    WEIGHT_UPDATE: "the tick the learner's new version was announced (engines are loading it)",
    CHECKPOINT: "a version staged in the object store but not announced yet: the learner has trained the "
                "step and is checkpointing it",
    BATCH_CUT: "the tick a new batch appeared on `batches` (the stream processor has just cut it)",
}


@dataclass(frozen=True)
class ChaosFault:
    what: str
    target: str  # two faults at once never share one
    moment: str = ANY
    kills: str | None = None  # the process it kills on purpose (restarted once by supervision)
    hold_s: float = 0.0  # how long a lasting fault stays before it is lifted


FAULTS: dict[str, ChaosFault] = {
    "env_worker_kill": ChaosFault("SIGKILL of env worker 0", "env-worker-0", kills="env-worker-0"),
    "streams_kill": ChaosFault("SIGKILL of the Faust worker as it cuts a batch", "streams", BATCH_CUT,
                               kills="streams"),
    "learner_kill": ChaosFault("SIGKILL of the learner between its optimizer step and its announcement "
                               "(while it stages and checkpoints)", "learner", CHECKPOINT, kills="learner"),
    "engine_kill": ChaosFault("SIGKILL of a current-pool engine during a weight update", "engine", WEIGHT_UPDATE,
                              kills="engine"),
    "engine_hang": ChaosFault("SIGSTOP of a current-pool engine during a weight update, SIGCONT after hold_s",
                              "engine", WEIGHT_UPDATE, hold_s=30.0),
    "kafka_restart": ChaosFault("restart of the Kafka broker", "kafka"),
    "kafka_disk_full": ChaosFault("the broker's log directory filled to within headroom of full, freed after "
                                  "hold_s", "kafka", hold_s=45.0),
    "minio_restart": ChaosFault("restart of MinIO during a checkpoint write", "minio", CHECKPOINT),
    "env_worker_slow": ChaosFault("env worker 1 stopped two seconds of every three for hold_s", "env-worker-1",
                                  hold_s=45.0),
    "poison_events": ChaosFault("an undecodable event on each input topic of the run", "topics"),
}

SCALED_DOWN = ("learner_kill", "engine_hang", "kafka_disk_full", "env_worker_slow")
"""What `make test` draws from: the faults `bench faults --scaled-down` does not already inject, with
their moments."""


@dataclass(frozen=True)
class ChaosSettings:
    minutes: float
    seed: int = 0
    faults: tuple[str, ...] = tuple(FAULTS)
    pair_probability: float = 0.3
    pause_s: tuple[float, float] = (10.0, 40.0)  # between an episode's recovery and the next injection
    start_version: int = 1
    moment_wait_s: float = 180.0
    recovery_limit_s: float = 600.0  # after the time is up, for the episode in flight
    drain_versions: int = 1  # versions after the lift that must hold work dispatched after it (see drain_versions())

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
        if not self.faults:
            raise ValueError("no fault to inject")
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.drain_versions < 1:
            raise ValueError(f"drain_versions must be at least 1, got {self.drain_versions}")
        if not 0 <= self.pair_probability <= 1:
            raise ValueError(f"pair_probability must lie in [0, 1], got {self.pair_probability}")


@dataclass
class Injected:
    """One fault of an episode and what became of it."""

    name: str
    episode: int
    injected_at_s: float
    version_at_injection: int
    moment: str  # the moment it went in at (ANY when its own did not come in time)
    detail: str = ""
    injected: bool = True  # False: the machine could not inject it (detail says why); it counts as nothing
    hit: str | None = None  # the process it hit (a child's name, an engine's id), when one
    killed: str | None = None  # the process it killed on purpose, restarted once by supervision
    lifted_at_s: float | None = None  # lasting faults: when lifted; the others: at injection
    version_at_lift: int | None = None  # the learner's version when the lift was first observed
    recovered_at_s: float | None = None
    poison: list[tuple[str, int, int]] = field(default_factory=list)
    poison_found: int = 0

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at_s is None else self.recovered_at_s - self.injected_at_s


@dataclass
class Episode:
    index: int
    faults: list[Injected]
    injected_at_s: float
    restarts_before: dict[str, int]

    @property
    def recovered(self) -> bool:
        return all(f.recovered_at_s is not None for f in self.faults)


class ChaosSchedule:
    """What to inject now, what is still open. Pure and seeded: times (seconds since the run's start),
    versions and the moments seen in."""

    def __init__(self, settings: ChaosSettings) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.deck: list[str] = []
        self.episodes: list[Episode] = []
        self.next_at_s = 0.0
        self.waiting_since_s: float | None = None
        self.planned: list[str] | None = None
        self.ended_at_s: float | None = None  # when the time was up with nothing open, or the limit passed

    @property
    def open(self) -> Episode | None:
        return self.episodes[-1] if self.episodes and not self.episodes[-1].recovered else None

    def time_up(self, now_s: float) -> bool:
        return now_s >= self.s.minutes * 60

    def done(self, now_s: float) -> bool:
        """No more faults: the time is up and the last episode recovered, or ran out of time."""
        if not self.time_up(now_s):
            return False
        episode = self.open
        return episode is None or now_s - max(self.s.minutes * 60, episode.injected_at_s) > self.s.recovery_limit_s

    def _draw(self) -> str:
        if not self.deck:
            self.deck = list(self.s.faults)
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def _plan(self) -> list[str]:
        first = self._draw()
        plan = [first]
        if len(self.s.faults) > 1 and self.rng.random() < self.s.pair_probability:
            # The second comes off the deck too, unless it hits the first one's target: then it goes back.
            for _ in range(len(self.deck) + 1):
                second = self._draw()
                if FAULTS[second].target != FAULTS[first].target:
                    plan.append(second)
                    break
                self.deck.insert(0, second)
        return plan

    def due(self, now_s: float, version: int, moments: Iterable[str]) -> list[str]:
        """The faults to inject now (none, one or two), given the learner's version and the moments this
        tick is in. The first fault's moment decides; a second goes in with it."""
        if self.open is not None or self.time_up(now_s) or version < self.s.start_version or now_s < self.next_at_s:
            return []
        if self.planned is None:
            self.planned, self.waiting_since_s = self._plan(), now_s
        seen = set(moments) | {ANY}
        if FAULTS[self.planned[0]].moment in seen or now_s - self.waiting_since_s >= self.s.moment_wait_s:
            return list(self.planned)
        return []

    def injected(self, now_s: float, version: int, moments: Iterable[str], faults: Sequence[Injected],
                 restarts: Mapping[str, int]) -> Episode:
        """Records the episode `due` asked for (its faults as the injector made them)."""
        if self.planned is None or [f.name for f in faults] != self.planned:
            raise ValueError(f"{[f.name for f in faults]} is not the planned episode {self.planned}")
        seen = set(moments) | {ANY}
        for f in faults:
            f.moment = FAULTS[f.name].moment if FAULTS[f.name].moment in seen else ANY
            if f.lifted_at_s is None and FAULTS[f.name].hold_s == 0:
                f.lifted_at_s, f.version_at_lift = now_s, version
            if not f.injected:  # nothing to recover from
                f.lifted_at_s = f.recovered_at_s = now_s
        episode = Episode(len(self.episodes), list(faults), now_s, dict(restarts))
        self.episodes.append(episode)
        self.planned = self.waiting_since_s = None
        return episode

    def observe(self, now_s: float, version: int, back: Mapping[str, bool],
                dead_letters: Iterable[tuple[str, int, int]] = ()) -> list[Injected]:
        """Marks the open episode's faults recovered: lifted, the learner past its version, what it hit
        back (`back` by fault name; missing means back) and its poison in `dlq`. Returns the newly
        recovered; schedules the next episode once all of them are."""
        episode = self.open
        if episode is None:
            return []
        found, newly = set(dead_letters), []
        for f in episode.faults:
            if f.recovered_at_s is not None:
                continue
            if f.poison:
                f.poison_found = sum(1 for p in f.poison if p in found)
            if f.lifted_at_s is not None and f.version_at_lift is None:
                f.version_at_lift = max(version, f.version_at_injection)
            drained = f.version_at_lift is not None and version >= f.version_at_lift + self.s.drain_versions
            if drained and back.get(f.name, True) and f.poison_found == len(f.poison):
                f.recovered_at_s = now_s
                newly.append(f)
        if episode.recovered:
            self.next_at_s = now_s + self.rng.uniform(*self.s.pause_s)
        return newly


def drain_versions(in_flight_bound: int, batch_size: int) -> int:
    """Versions after a lift by which the learner must have trained a group dispatched after it: the
    groups in flight at the lift fill at most ceil(bound / batch_size) batches; the one after holds new
    work."""
    if in_flight_bound < 1 or batch_size < 1:
        raise ValueError(f"in_flight_bound and batch_size must be positive, got {in_flight_bound}, {batch_size}")
    return -(-in_flight_bound // batch_size) + 1


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def trained_twice(batches: Iterable[Mapping[str, Any]], weights: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Batches trained into two versions, and trajectories trained in two batches (each counted once
    per batch they were trained in beyond the first), from the replayed `batches` and `weights`."""
    versions_of: dict[str, set[int]] = defaultdict(set)
    for w in weights:
        if w.get("batch_id") is not None:
            versions_of[w["batch_id"]].add(w["version"])
    trained = set(versions_of)
    members: dict[str, set[str]] = {}
    for b in batches:
        if b["batch_id"] in trained:
            members[b["batch_id"]] = {item["trajectory"]["trajectory_id"] for item in b["items"]}
    seen: Counter[str] = Counter()
    for ids in members.values():
        seen.update(ids)
    return {"batches": sum(len(v) - 1 for v in versions_of.values()),
            "trajectories": sum(n - 1 for n in seen.values() if n > 1),
            "trained_batches": len(trained), "trained_trajectories": len(seen)}


def restarts_in(episodes: Sequence[Episode], final: Mapping[str, int]) -> list[dict[str, int]]:
    """Processes the run restarted in each episode's window (its injection to the next one's)."""
    out = []
    for i, episode in enumerate(episodes):
        after = episodes[i + 1].restarts_before if i + 1 < len(episodes) else final
        before = episode.restarts_before
        out.append({name: n - before.get(name, 0) for name, n in sorted(after.items()) if n > before.get(name, 0)})
    return out


def episode_findings(episode: Episode, restarted: Mapping[str, int]) -> list[str]:
    """Restarts in an episode's window that none of its faults asked for: each killed process is
    expected to come back once, anything else should have ridden through."""
    expected = Counter(f.killed for f in episode.faults if f.killed is not None and f.injected)
    names = " + ".join(f.name for f in episode.faults)
    return [f"{name} exited during {names} and was restarted{f' {n - expected[name]} more times' if expected[name] else ''}"
            + (": it should ride through it" if not expected[name] else "")
            for name, n in sorted(restarted.items()) if n > expected[name]]


def redone_in(repeats: Mapping[str, Sequence[int]], episodes: Sequence[Episode], started_ms: int
              ) -> list[dict[str, int]]:
    """Per episode, the ids published again inside its window, per topic; `repeats` holds, per topic,
    the times (ms) at which an id already seen was published again."""
    out = []
    for i, episode in enumerate(episodes):
        start = started_ms + episode.injected_at_s * 1000
        end = started_ms + episodes[i + 1].injected_at_s * 1000 if i + 1 < len(episodes) else None
        out.append({topic: sum(1 for at in stamps if at >= start and (end is None or at < end))
                    for topic, stamps in repeats.items()})
    return out


def chaos_table(episodes: Sequence[Episode], redone: Sequence[Mapping[str, int]], restarted: Sequence[Mapping[str, int]],
                verify_report: Mapping[str, Any], twice: Mapping[str, Any], left_behind: Sequence[str]
                ) -> dict[str, Any]:
    """The benchmark's figures: per fault kind, per episode, and the run's totals with `ratio` =
    losses + batches trained twice + trajectories trained twice, and `ok` (ratio 0, no finding, verify
    clean, nothing left behind)."""
    rows, kinds = [], {}
    per_kind: dict[str, dict[str, Any]] = {}
    for episode, work, again in zip(episodes, redone, restarted, strict=True):
        findings = episode_findings(episode, again)
        unrecovered = sum(1 for f in episode.faults if f.recovered_at_s is None)
        missing = sum(len(f.poison) - f.poison_found for f in episode.faults)
        rows.append({"episode": episode.index, "at_s": round(episode.injected_at_s, 1),
                     "faults": [{"fault": f.name, "moment": f.moment, "injected": f.injected, "detail": f.detail,
                                 "at_version": f.version_at_injection,
                                 "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 1),
                                 "poison_in_dlq": f"{f.poison_found}/{len(f.poison)}" if f.poison else None}
                                for f in episode.faults],
                     "redone": dict(work), "restarted": dict(again), "findings": findings,
                     "losses": unrecovered + missing})
        for f in episode.faults:
            k = per_kind.setdefault(f.name, {"count": 0, "not_injected": 0, "at_moment": 0, "recovery_s": [],
                                             "unrecovered": 0, "redone": Counter(), "together_with": Counter()})
            if not f.injected:
                k["not_injected"] += 1
                continue
            k["count"] += 1
            k["at_moment"] += f.moment == FAULTS[f.name].moment
            if f.recovery_s is None:
                k["unrecovered"] += 1
            else:
                k["recovery_s"].append(f.recovery_s)
            k["redone"].update(work)
            k["together_with"].update(g.name for g in episode.faults if g is not f)
    for name, k in per_kind.items():
        times = k.pop("recovery_s")
        kinds[name] = {**k, "what": FAULTS[name].what, "moment": FAULTS[name].moment,
                       "recovery_s": {"p50": _quantile(times, 0.5), "p90": _quantile(times, 0.9),
                                      "max": max(times) if times else None, "all": [round(t, 1) for t in times]},
                       "redone": dict(k["redone"]), "together_with": dict(k["together_with"])}
    mismatches = {c["name"]: len(c["mismatches"]) for c in verify_report.get("checks", []) if c["mismatches"]}
    # Batches trained twice are counted once, below, not also as a loss.
    verify_losses = sum(n for name, n in mismatches.items() if name in LOSS_CHECKS and name != "batches_trained_once")
    losses = sum(r["losses"] for r in rows) + verify_losses
    ratio = losses + twice["batches"] + twice["trajectories"]
    findings = sum(len(r["findings"]) for r in rows)
    ok = ratio == 0 and findings == 0 and not mismatches and not left_behind
    return {"ratio": ratio, "ok": ok, "losses": losses, "batches_trained_twice": twice["batches"],
            "trajectories_trained_twice": twice["trajectories"], "findings": findings,
            "episodes": len(rows), "pairs": sum(1 for r in rows if len(r["faults"]) > 1),
            "faults_injected": sum(k["count"] for k in kinds.values()), "per_fault": kinds, "episode_rows": rows,
            "trained": {"batches": twice["trained_batches"], "trajectories": twice["trained_trajectories"]},
            "left_behind": list(left_behind),
            "verify": {"ok": not mismatches, "mismatches": mismatches,
                       "not_checked": verify_report.get("not_checked", {}),
                       "pending_groups": len(verify_report.get("pending_groups", []))}}


def ballast_bytes(free_bytes: int, headroom_bytes: int) -> int:
    """How much to allocate so that `headroom_bytes` stay free (0 when less is free already)."""
    return max(0, free_bytes - headroom_bytes)


def slow_phase(elapsed_s: float, period_s: float = 3.0, stopped_s: float = 2.0) -> bool:
    """Whether a slow env worker is stopped at `elapsed_s` into its fault: stopped the first
    `stopped_s` of every `period_s`."""
    return elapsed_s % period_s < stopped_s


__all__ = ["ANY", "BATCH_CUT", "CHECKPOINT", "FAULTS", "MOMENTS", "SCALED_DOWN", "WEIGHT_UPDATE", "ChaosFault",
           "ChaosSchedule", "ChaosSettings", "Episode", "Injected", "ballast_bytes", "chaos_table",
           "episode_findings", "redone_in", "restarts_in", "slow_phase",
           "trained_twice"]
