"""The dispatcher's pure planning: which groups to request next, how many, and when to validate.

Order (AgentRL's interleave + cycle): the configured training sources (task family, split,
sample count) take turns round-robin, `weight` groups each per turn (AgentRL: one each); each
source cycles through its own samples independently, and a source's `epoch` counts its completed
passes. With weights all 1, global position k maps to source k % S, the j = k // S-th group of
that source: sample j % count, epoch j // count. Because this mapping is a pure function of k, the
cursor is just a position, and a restart rebuilds it from what tasks.requested already holds.
A run seed other than 0 visits each source's samples in a shuffled order, a permutation of its own
per (seed, source, epoch) (`sample_order`); seed 0 keeps the samples in index order.

Flow control: at most max_in_flight groups may be dispatched and not yet in a trained batch
(AgentRL's queue size, 2 x batch_size groups), which bounds off-policy drift without a barrier.

Validation: every val_interval learner versions, round r = version // val_interval dispatches
every sample of the validation sources with n = 4, validation=True (the router keeps those on the
current pool), and epoch = r so each round has its own group ids.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.ids import group_id
from schemas.prometheus import MetricsHost, MetricsPort


class TaskSource(BaseModel):
    """One (task family, split) the dispatcher draws samples from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str
    """Task family (data_source), e.g. os, db, kg, webshop, alfworld."""
    split: str
    """Split of the family's data, e.g. train, dev."""
    count: int = Field(ge=1)
    """Number of samples in that split (sample indices 0..count-1)."""
    weight: int = Field(1, ge=1)
    """Groups it contributes per turn of the round-robin (AgentRL: 1 for every task)."""


class DispatcherSettings(BaseModel):
    """Settings of the dispatcher (pipeline/); composed into the run configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[TaskSource, ...] = Field(min_length=1)
    """Training sources, interleaved round-robin in this order (paper: five task families)."""
    validation_sources: tuple[TaskSource, ...] = ()
    """Validation sources, every sample dispatched each validation round (paper: the dev splits)."""
    group_size: int = Field(8, ge=1)
    """Rollouts per training sample, n (paper: 8)."""
    batch_size: int = Field(256, ge=1)
    """Groups per training batch (paper: 256); sets the default in-flight bound."""
    max_in_flight_groups: int | None = Field(None, ge=1)
    """Groups dispatched and not yet in a trained batch; None means 2 x batch_size (AgentRL's queue size)."""
    val_interval: int = Field(25, ge=1)
    """Validate every this many learner versions (paper: every 25 steps)."""
    val_group_size: int = Field(4, ge=1)
    """Rollouts per validation sample (paper: n = 4)."""
    val_before_train: bool = True
    """Run validation round 0 at version 0, before any training step (verl's val_before_train)."""
    seed: int = Field(0, ge=0)
    """The run seed (rollstream's): other than 0, each source's samples come in a shuffled order per epoch."""
    metrics_port: MetricsPort = None
    """Port of the dispatcher's Prometheus /metrics (rollstream's), None none, 0 any free port
    (schemas/prometheus.py)."""
    metrics_host: MetricsHost = "127.0.0.1"
    """Address the dispatcher's /metrics binds (rollstream's): 0.0.0.0 lets a scraper on another host (a Kubernetes
    pod's Prometheus) reach it; loopback by default so a process opens nothing it was not asked for."""

    @model_validator(mode="after")
    def _train_and_validation_sources_are_disjoint(self) -> DispatcherSettings:
        # group ids hash (run, task, split, sample_index, epoch): a (task, split) used for both
        # training and validation would give a training and a validation group the same id.
        train = {(s.task, s.split) for s in self.sources}
        both = train & {(s.task, s.split) for s in self.validation_sources}
        if both:
            raise ValueError(f"(task, split) used for training and validation: {sorted(both)}")
        if len(train) != len(self.sources):
            raise ValueError("a (task, split) is listed twice in sources")
        return self

    @property
    def in_flight_bound(self) -> int:
        """The in-flight limit in groups."""
        return in_flight_bound(self.batch_size, self.max_in_flight_groups)


@dataclass(frozen=True)
class Slot:
    """One group to dispatch: the sample it rolls out."""

    task: str
    split: str
    sample_index: int
    epoch: int


@dataclass(frozen=True)
class Cursor:
    """Where training dispatch stands: the first position not dispatched yet, and positions past
    it that already were (a restart can find gaps: a crash between two produces, or group events
    spread over partitions), which are skipped instead of dispatched twice."""

    position: int = 0
    ahead: frozenset[int] = frozenset()


@functools.lru_cache(maxsize=256)
def sample_order(seed: int, task: str, split: str, count: int, epoch: int) -> tuple[tuple[int, ...], dict[int, int]]:
    """(the sample indices in the order one epoch of a source visits them, each index's place in it):
    index order for seed 0, else a permutation drawn from (seed, task, split, epoch) alone, so every
    process and every restart of the run draws the same one (a str seeds `random` through sha512,
    independent of PYTHONHASHSEED)."""
    order = list(range(count))
    if seed:
        random.Random(f"{seed}/{task}/{split}/{epoch}").shuffle(order)
    return tuple(order), {index: place for place, index in enumerate(order)}


def slot_at(sources: Sequence[TaskSource], position: int, seed: int = 0) -> Slot:
    """The sample at global interleave position `position` (in the order of run seed `seed`)."""
    turn, offset = divmod(position, sum(source.weight for source in sources))
    for source in sources:
        if offset < source.weight:
            j = turn * source.weight + offset  # the source's j-th group
            epoch = j // source.count
            order, _ = sample_order(seed, source.task, source.split, source.count, epoch)
            return Slot(source.task, source.split, order[j % source.count], epoch)
        offset -= source.weight
    raise AssertionError("unreachable: offset < the sum of the weights")


def position_of(sources: Sequence[TaskSource], slot: Slot, seed: int = 0) -> int:
    """Inverse of slot_at; ValueError when the slot does not belong to the training sources."""
    before = 0  # positions of the other sources ahead of this one in each turn
    for source in sources:
        if (source.task, source.split) == (slot.task, slot.split):
            if not 0 <= slot.sample_index < source.count or slot.epoch < 0:
                raise ValueError(f"{slot} is outside {source.task}/{source.split} (count {source.count})")
            _, place = sample_order(seed, source.task, source.split, source.count, slot.epoch)
            turn, offset = divmod(slot.epoch * source.count + place[slot.sample_index], source.weight)
            return turn * sum(s.weight for s in sources) + before + offset
        before += source.weight
    raise ValueError(f"{slot.task}/{slot.split} is not a training source")


def cursor_from_dispatched(sources: Sequence[TaskSource], dispatched: Iterable[Slot], seed: int = 0) -> Cursor:
    """Rebuilds the cursor from the training groups already in tasks.requested, so a restart
    neither re-dispatches nor skips a sample."""
    done = {position_of(sources, s, seed) for s in dispatched}
    position = 0
    while position in done:
        position += 1
    return Cursor(position, frozenset(p for p in done if p > position))


def next_slots(sources: Sequence[TaskSource], cursor: Cursor, budget: int, seed: int = 0) -> tuple[list[Slot], Cursor]:
    """Up to `budget` next slots in interleave order, skipping already-dispatched positions, and
    the cursor after them."""
    slots: list[Slot] = []
    position, ahead = cursor.position, set(cursor.ahead)
    while len(slots) < budget:
        if position in ahead:
            ahead.discard(position)
        else:
            slots.append(slot_at(sources, position, seed))
        position += 1
    while position in ahead:
        ahead.discard(position)
        position += 1
    return slots, Cursor(position, frozenset(ahead))


def in_flight(dispatched: Iterable[str], trained: Iterable[str], released: Iterable[str] = ()) -> int:
    """Training groups dispatched and neither in a trained batch nor released (dropped by the
    aggregator, which never reach a batch and would otherwise hold credit forever)."""
    return len(set(dispatched) - set(trained) - set(released))


def in_flight_bound(batch_size: int, max_in_flight_groups: int | None) -> int:
    """The most groups dispatched and not yet trained: max_in_flight_groups, or two batches (AgentRL's queue)."""
    return max_in_flight_groups if max_in_flight_groups is not None else 2 * batch_size


def dispatch_budget(settings: DispatcherSettings, groups_in_flight: int) -> int:
    """How many more groups may be dispatched now."""
    return max(0, settings.in_flight_bound - groups_in_flight)


def requests_for(run: str, slot: Slot, group_size: int, validation: bool, policy_version: int,
                 now_ms: int) -> list[dict[str, Any]]:
    """The n task_requested events (schemas/avro/task_requested.avsc) of one group."""
    gid = group_id(run, slot.task, slot.split, slot.sample_index, slot.epoch)
    return [{
        "run": run,
        "group_id": gid,
        "member": member,
        "group_size": group_size,
        "task": slot.task,
        "split": slot.split,
        "sample_index": slot.sample_index,
        "epoch": slot.epoch,
        "validation": validation,
        "policy_version": policy_version,
        "dispatched_at_ms": now_ms,
    } for member in range(group_size)]


def plan_training(run: str, settings: DispatcherSettings, cursor: Cursor, groups_in_flight: int,
                  policy_version: int, now_ms: int) -> tuple[list[dict[str, Any]], Cursor]:
    """The training requests to send now (whole groups, within the in-flight bound) and the new cursor."""
    slots, cursor = next_slots(settings.sources, cursor, dispatch_budget(settings, groups_in_flight), settings.seed)
    events = [e for s in slots for e in requests_for(run, s, settings.group_size, False, policy_version, now_ms)]
    return events, cursor


def validation_round_due(learner_version: int, done_rounds: Iterable[int], settings: DispatcherSettings) -> int | None:
    """The validation round to dispatch at this learner version, if any: the latest round
    (version // val_interval) not yet dispatched. Rounds the learner jumped past are not made up."""
    if not settings.validation_sources:
        return None
    latest = learner_version // settings.val_interval
    if latest == 0 and not settings.val_before_train:
        return None
    return None if latest in set(done_rounds) else latest


def plan_validation(run: str, settings: DispatcherSettings, round_: int, policy_version: int,
                    now_ms: int) -> list[dict[str, Any]]:
    """Every sample of every validation source, n = val_group_size, validation=True, epoch = round."""
    return validation_requests(run, settings.validation_sources, settings.val_group_size, round_, policy_version, now_ms)


def validation_requests(run: str, sources: Sequence[TaskSource], group_size: int, round_: int, policy_version: int,
                        now_ms: int) -> list[dict[str, Any]]:
    """The requests of one validation round over `sources` (also what `rollstream eval` sends)."""
    return [e for s in sources for i in range(s.count)
            for e in requests_for(run, Slot(s.task, s.split, i, round_), group_size, True, policy_version, now_ms)]
