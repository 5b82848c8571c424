"""`rollstream bench faults`, the pure part: when each fault goes in, when the run has recovered from
it, what was redone and what was lost.

One fault at a time. A fault is injected once the learner has published `start_version` (the first)
or as soon as the previous fault has recovered; it has recovered when the learner has published
`recover_versions` more versions than it had at injection (training goes on by itself), the
component it hit is back (the killed process restarted, the engine serving again) and, for a
poison event, every poison event sits in `dlq` with a reason. A fault still unrecovered at the
end of the run counts as one loss. Work redone is counted from the replayed topics: an id published
again (trajectory, group, batch, weight version) inside the fault's window. Losses are what
`replay verify` finds, plus poison events missing from `dlq`: zero when all is well.

Supervision restarts a process that exits, so a run can recover from a fault by crashing and
starting again; that hides a process that does not ride through what it should. Each fault kills
at most one process on purpose (`KILLS`); any other restart in its window, or a second one of the
killed process, is a finding: a broker or object-store restart, a poison event or another
process's death must be ridden through. Findings fail the run like losses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import topics

FAULTS: dict[str, str] = {
    "env_worker_kill": "SIGKILL of an env worker (restarted; its uncommitted tasks go to the others)",
    "streams_kill": "SIGKILL of the Faust worker (restarted from its changelogs and committed offsets)",
    "learner_kill": "SIGKILL of the learner (restarted with --resume from its last checkpoint)",
    "engine_kill": "SIGKILL of a current-pool engine (restarted on the version it should hold)",
    "kafka_restart": "restart of the Kafka broker",
    "minio_restart": "restart of MinIO right after a learner step (during its weight publish)",
    "poison_events": "an undecodable event on each input topic of the run",
}
KILLS: dict[str, str | None] = {
    "env_worker_kill": "env-worker-0",
    "streams_kill": "streams",
    "learner_kill": "learner",
    "engine_kill": None,  # a current-pool engine: its id is named at injection (FaultRecord.killed)
}
"""The process each fault kills on purpose, restarted once by the run's supervision. The faults not
listed kill nothing: every process must ride through them."""

SCALED_DOWN = ("env_worker_kill", "streams_kill", "learner_kill", "kafka_restart", "poison_events")
"""What `make test` injects: the processes, the broker under every client, and the bad input. Object
store and engine restarts take minutes each on two cores; `rollstream bench faults` runs them all."""

POISON_TOPICS = (topics.TASKS_REQUESTED, topics.TASKS, topics.TRAJECTORIES, topics.GROUPS, topics.BATCHES,
                 topics.WEIGHTS)
"""Every topic a process of the run consumes: dispatcher requests (router), tasks (env workers),
trajectories (aggregator), groups (batcher), batches (learner), weights (engines)."""

# Checks of `replay verify` whose mismatches are losses (the others are computation errors, which
# also count: a clean run reports none at all).
LOSS_CHECKS = ("groups_reach_batches", "batches_trained_once", "trajectory_ids_unique",
               "learner_versions_continuous", "group_members_match_trajectories")

DUPLICATE_KEYS = {topics.TRAJECTORIES: "trajectory_id", topics.GROUPS: "group_id", topics.BATCHES: "batch_id",
                  topics.WEIGHTS: "version"}


@dataclass
class FaultRecord:
    """One injected fault and what became of it."""

    name: str
    injected_at_ms: int
    version_at_injection: int
    detail: str = ""
    recovered_at_ms: int | None = None
    poison: list[tuple[str, int, int]] = field(default_factory=list)  # (topic, partition, offset) produced
    poison_found: int = 0
    restarts_before: dict[str, int] = field(default_factory=dict)  # the run's restart counts at injection
    killed: str | None = None  # the process the fault killed on purpose (KILLS), None for the others

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at_ms is None else (self.recovered_at_ms - self.injected_at_ms) / 1000


class FaultSchedule:
    """Which fault to inject next, and when the current one has recovered. Pure: versions and times in."""

    def __init__(self, faults: Sequence[str], start_version: int = 1, recover_versions: int = 1) -> None:
        unknown = [f for f in faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
        if not faults:
            raise ValueError("no fault to inject")
        self.pending = list(faults)
        self.start_version, self.recover_versions = start_version, recover_versions
        self.records: list[FaultRecord] = []

    @property
    def current(self) -> FaultRecord | None:
        """The injected fault not yet recovered, if any."""
        return self.records[-1] if self.records and self.records[-1].recovered_at_ms is None else None

    @property
    def done(self) -> bool:
        return not self.pending and self.current is None

    def due(self, version: int) -> str | None:
        """The fault to inject now, given the learner's published version."""
        if not self.pending or self.current is not None:
            return None
        return self.pending[0] if version >= self.start_version else None

    def injected(self, name: str, version: int, now_ms: int, detail: str = "",
                 poison: Sequence[tuple[str, int, int]] = (), restarts: Mapping[str, int] | None = None,
                 killed: str | None = None) -> FaultRecord:
        """Records an injection that began at now_ms (a broker restart takes a while: its recovery
        time counts from the moment it went down). `killed` names the process killed on purpose when
        KILLS cannot (an engine's id); by default it is KILLS' entry."""
        if name != self.due(version):
            raise ValueError(f"{name} is not due")
        self.pending.pop(0)
        record = FaultRecord(name, now_ms, version, detail, poison=list(poison), restarts_before=dict(restarts or {}),
                             killed=killed if killed is not None else KILLS.get(name))
        self.records.append(record)
        return record

    def observe(self, version: int, now_ms: int, dead_letters: Iterable[tuple[str, int, int]] = (),
                component_back: bool = True) -> None:
        """Marks the current fault recovered when the learner moved on, the component it hit is back
        (a killed process running again, an engine serving again) and its poison reached dlq."""
        record = self.current
        if record is None:
            return
        if record.poison:
            found = set(dead_letters)
            record.poison_found = sum(1 for p in record.poison if p in found)
        if version >= record.version_at_injection + self.recover_versions and component_back \
                and record.poison_found == len(record.poison):
            record.recovered_at_ms = now_ms

    def versions_needed(self) -> int:
        """Learner steps a run needs for every fault to be injected and recovered: twice what each
        needs at least (a recovery often spans more versions than the minimum), and one to spare."""
        return self.start_version + 2 * len(self.pending) * self.recover_versions + 1


def repeated_ids(records_by_topic: Mapping[str, Sequence[Any]]) -> dict[str, list[int]]:
    """Per topic, the times (ms) at which an id already published was published again: the work a
    fault made the run redo (topics without a repeat left out). `records_by_topic` holds
    ReplayRecord-like objects (timestamp_ms, value)."""
    repeats: dict[str, list[int]] = {}
    for topic, key in DUPLICATE_KEYS.items():
        seen: set[Any] = set()
        stamps: list[int] = []
        for r in sorted(records_by_topic.get(topic, ()), key=lambda r: r.timestamp_ms):
            if topic == topics.WEIGHTS and r.value.get("batch_id") is None:
                continue  # the initial version and stale-pool announcements are not training work
            ident = r.value[key]
            if ident in seen:
                stamps.append(r.timestamp_ms)
            seen.add(ident)
        if stamps:
            repeats[topic] = stamps
    return repeats


def redone(records_by_topic: Mapping[str, Sequence[Any]], faults: Sequence[FaultRecord]) -> list[dict[str, int]]:
    """Per fault, the ids published again inside its window (from its injection to the next one's),
    per topic."""
    repeats = repeated_ids(records_by_topic)
    out = []
    for i, fault in enumerate(faults):
        end = faults[i + 1].injected_at_ms if i + 1 < len(faults) else None
        out.append({topic: sum(1 for at in stamps if at >= fault.injected_at_ms and (end is None or at < end))
                    for topic, stamps in repeats.items()})
    return out


def dead_letter_positions(letters: Iterable[Mapping[str, Any]]) -> set[tuple[str, int, int]]:
    """(topic, partition, offset) of every dead letter that carries a reason."""
    return {(d["source_topic"], d["source_partition"], d["source_offset"]) for d in letters if d.get("reason")}


def restarts_per_fault(faults: Sequence[FaultRecord], final: Mapping[str, int]) -> list[dict[str, int]]:
    """Processes the run restarted in each fault's window (from its injection to the next one's):
    the process it killed, and whatever else the fault brought down."""
    out = []
    for i, fault in enumerate(faults):
        after = faults[i + 1].restarts_before if i + 1 < len(faults) else final
        out.append({name: n - fault.restarts_before.get(name, 0) for name, n in sorted(after.items())
                    if n > fault.restarts_before.get(name, 0)})
    return out


def unexpected_restarts(fault: FaultRecord, restarted: Mapping[str, int]) -> dict[str, int]:
    """The restarts in a fault's window that the fault did not cause on purpose: all of them, but one
    of the process it killed."""
    expected = {fault.killed: 1} if fault.killed is not None else {}
    return {name: n - expected.get(name, 0) for name, n in sorted(restarted.items()) if n > expected.get(name, 0)}


def findings(fault: FaultRecord, restarted: Mapping[str, int]) -> list[str]:
    """What the fault table reports of unexpected restarts: each process that exited during a fault
    it should have ridden through."""
    return [f"{name} exited during {fault.name} and was restarted{f' {n} times' if n > 1 else ''}"
            + (" (again after its own kill)" if name == fault.killed else ": it should ride through it")
            for name, n in unexpected_restarts(fault, restarted).items()]


def fault_table(faults: Sequence[FaultRecord], redone_per_fault: Sequence[Mapping[str, int]],
                verify_report: Mapping[str, Any], final_restarts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The benchmark's figures: one row per fault, the verify row, the total of losses and findings
    (`ratio`: 0 when the run lost nothing and every process rode through what it should) and `ok`."""
    rows = []
    restarted = restarts_per_fault(faults, final_restarts or {})
    for fault, work, again in zip(faults, redone_per_fault, restarted):
        missing = len(fault.poison) - fault.poison_found
        losses = (0 if fault.recovered_at_ms is not None else 1) + missing
        rows.append({"fault": fault.name, "what": FAULTS[fault.name], "detail": fault.detail,
                     "injected_at_version": fault.version_at_injection,
                     "recovered": fault.recovered_at_ms is not None, "recovery_s": fault.recovery_s,
                     "redone": dict(work), "restarted": again, "findings": findings(fault, again),
                     "poison_in_dlq": f"{fault.poison_found}/{len(fault.poison)}" if fault.poison else None,
                     "losses": losses})
    mismatches = {c["name"]: len(c["mismatches"]) for c in verify_report.get("checks", []) if c["mismatches"]}
    verify_losses = sum(mismatches.values())
    total = sum(r["losses"] for r in rows) + verify_losses
    found = sum(len(r["findings"]) for r in rows)
    return {"ratio": total + found, "ok": total + found == 0, "losses": total, "findings": found, "faults": rows,
            "verify": {"ok": verify_losses == 0, "mismatches": mismatches,
                       "loss_checks": {name: mismatches.get(name, 0) for name in LOSS_CHECKS},
                       "not_checked": verify_report.get("not_checked", {}),
                       "pending_groups": len(verify_report.get("pending_groups", []))}}
