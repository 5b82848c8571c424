"""`verify`: re-derives a run's advantages and token invariants from its replayed events alone,
and the payload references it follows (arrays kept in another event, batches whose stored object
is gone).

Verification re-implements ARCHITECTURE.md's formulas with numpy, independently of streams/ (only the
default std kind and eps are taken from streams' settings, so a default run verifies with the
values it ran with). The rules at the edges are the live path's documented ones: masked members
(status task_error) take no part and get 0; a group of one unmasked member uses mean 0, std 1;
a std over fewer than two tokens is 0; a task whose token std is 0 gets final advantage 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.analysis.replay_columns import action_tokens
from pipeline.analysis.replay_records import ReplayRecord
from schemas import eventref, topics
from schemas.arrays import unpack_ids, unpack_logprobs, unpack_mask
from streams.settings import Advantage, StdKind, StreamsSettings

TASK_ERROR = "task_error"


_S = StreamsSettings()


class VerifySettings(BaseModel):
    """How `verify` recomputes a run's advantages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    std: StdKind = _S.std
    """Std of GRPO and task normalization: the live path's default (Bessel-corrected, as torch in AgentRL)."""
    eps: float = Field(_S.eps, gt=0)
    """Added to every std (AgentRL: 1e-6), the live path's default."""
    tolerance: float = Field(1e-4, gt=0)
    """Largest accepted difference between a recorded and a recomputed advantage, relative above magnitude 1."""
    task_adv_norm: bool = True
    """Whether the run task-normalized its advantages (`streams.task_adv_norm`); off, each item's final
    advantage must equal its GRPO group advantage."""
    advantage: Advantage = "group"
    """Whether the run's streams computed advantages (`streams.advantage`); "none" (SAO, whose learner computes
    them), every member's and every item's advantage must be 0."""
    task_advantage_scale: dict[str, float] = {}
    """Each family's scale of its final advantages (`streams.task_advantage_scale`); families not named 1."""
    logprob_tolerance: float = Field(1e-4, gt=0)
    """Largest accepted difference between the rollout log-probs of two copies of one trajectory: a
    re-rollout repeats every token, but its log-probs come from another engine batch (measured: 5e-7)."""


@dataclass(frozen=True)
class Mismatch:
    """One disagreement, with the ids that locate it."""

    ids: dict[str, str | int]
    detail: str


@dataclass
class CheckResult:
    """One check: how many things it looked at and every mismatch it found."""

    name: str
    description: str
    checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    def fail(self, detail: str, **ids: str | int) -> None:
        self.mismatches.append(Mismatch(dict(ids), detail))


@dataclass
class VerifyReport:
    """Everything `verify` found; `as_dict()` is JSON-serializable."""

    run: str | None
    settings: dict[str, Any]
    counts: dict[str, int]
    dead_letters: dict[str, int]
    undecodable: dict[str, int]
    not_checked: dict[str, int]
    pending_groups: list[str]
    checks: list[CheckResult]

    @property
    def mismatches(self) -> int:
        return sum(len(c.mismatches) for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mismatches": self.mismatches, "ok": self.ok}


def _close(recorded: float, expected: float, tolerance: float) -> bool:
    return abs(recorded - expected) <= tolerance * max(1.0, abs(expected))


def _mean_std(values: np.ndarray, weights: np.ndarray, std: StdKind) -> tuple[float, float]:
    """Weighted mean and std, value i counted weights[i] times; the std of fewer than two items is 0."""
    n = float(weights.sum())
    if n == 0:
        return 0.0, 0.0
    mean = float((values * weights).sum() / n)
    dof = n - (1.0 if std == "bessel" else 0.0)
    if dof <= 0:
        return mean, 0.0
    return mean, float(np.sqrt((weights * (values - mean) ** 2).sum() / dof))


def grpo(rewards: Sequence[float], masked: Sequence[bool], s: VerifySettings) -> tuple[np.ndarray, float, float]:
    """GRPO advantages of one group, (R - mean) / (std + eps) over the unmasked members (masked: 0),
    with the mean and std used; a lone unmasked member uses mean 0 and std 1."""
    r = np.asarray(rewards, dtype=np.float64)
    keep = ~np.asarray(masked, dtype=bool)
    out = np.zeros(len(r))
    counted = r[keep]
    if len(counted) == 0:
        return out, 0.0, 0.0
    mean, sd = (0.0, 1.0) if len(counted) == 1 else _mean_std(counted, np.ones(len(counted)), s.std)
    out[keep] = (counted - mean) / (sd + s.eps)
    return out, mean, sd


def task_normalized(advantages: Sequence[float], tasks: Sequence[str], tokens: Sequence[int],
                    s: VerifySettings) -> tuple[np.ndarray, dict[str, dict[str, float]]]:
    """Per task, the action tokens' advantages standardized token-weighted: (A - mu) / (sigma + eps),
    0 when sigma is 0. Returns the final advantages and per-task statistics."""
    a, w = np.asarray(advantages, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    out = np.zeros(len(a))
    stats: dict[str, dict[str, float]] = {}
    for task in sorted(set(tasks)):
        idx = np.array([i for i, t in enumerate(tasks) if t == task])
        mean, sd = _mean_std(a[idx], w[idx], s.std)
        if sd > 0:
            out[idx] = (a[idx] - mean) / (sd + s.eps)
        stats[task] = {"trajectories": len(idx), "tokens": int(w[idx].sum()), "mean_before": mean, "std_before": sd}
    return out, stats


def _content(t: Mapping[str, Any]) -> tuple[Any, ...]:
    """What training reads of a trajectory, its rollout log-probs apart (see same_content). Timings,
    worker and engine ids are left out (a redelivered rollout may differ in them alone)."""
    return (t["run"], t["group_id"], t["member"], t["task"], t["split"], t["sample_index"], t["validation"],
            t["input_ids"], t["loss_mask"], t["arrays_uri"], t["num_tokens"],
            t["prompt_tokens"], t["status"], t["reward"], t["env_reward"], t["termination"],
            tuple((u["turn"], u["start"], u["length"], u["weight_version"]) for u in t["turns"]))


def same_content(a: Mapping[str, Any], b: Mapping[str, Any], logprob_tolerance: float) -> bool:
    """Two events of one trajectory agree on what training reads: everything exactly, the rollout
    log-probs within `logprob_tolerance` (an engine's numerics depend on what it batched alongside)."""
    if a is b:
        return True
    if _content(a) != _content(b):
        return False
    if a["rollout_logprobs"] == b["rollout_logprobs"]:
        return True
    la, lb = unpack_logprobs(a["rollout_logprobs"]), unpack_logprobs(b["rollout_logprobs"])
    return la.shape == lb.shape and bool(np.all(np.abs(la - lb) <= logprob_tolerance))


def token_problems(t: Mapping[str, Any]) -> list[str]:
    """Token-in-token-out invariants of one trajectory with inline arrays; empty when it holds."""
    try:
        ids, mask, lp = unpack_ids(t["input_ids"]), unpack_mask(t["loss_mask"]), unpack_logprobs(t["rollout_logprobs"])
    except ValueError as e:
        return [f"unreadable token arrays: {e}"]
    n = len(ids)
    if len(mask) != n or len(lp) != n:
        return [f"lengths differ: input_ids {n}, loss_mask {len(mask)}, rollout_logprobs {len(lp)}"]
    problems = []
    if t["num_tokens"] != n:
        problems.append(f"num_tokens {t['num_tokens']} but {n} input ids")
    if np.any(mask > 1):
        problems.append("loss_mask holds values other than 0 and 1")
    if not 0 <= t["prompt_tokens"] <= n or np.any(mask[:t["prompt_tokens"]]):
        problems.append(f"prompt tokens (first {t['prompt_tokens']}) are not all masked")
    if not np.all(np.isfinite(lp)):
        problems.append("non-finite log-probs")
    bad = np.flatnonzero((mask == 0) & (lp != 0))
    if len(bad):
        problems.append(f"log-prob not 0 where loss_mask is 0 at {len(bad)} positions, first {int(bad[0])}")
    if np.any(lp[mask == 1] > 0):
        problems.append("positive log-prob on a generated token")
    spans = np.zeros(n, dtype=np.uint8)
    end = t["prompt_tokens"]
    for i, turn in enumerate(t["turns"]):
        if turn["turn"] != i or turn["start"] < end or turn["start"] + turn["length"] > n:
            problems.append(f"turn record {i} (turn {turn['turn']}, start {turn['start']}, length "
                            f"{turn['length']}) is out of order or outside the tokens")
            return problems
        spans[turn["start"]:turn["start"] + turn["length"]] = 1
        end = turn["start"] + turn["length"]
    if not np.array_equal(spans, mask):
        problems.append("loss_mask 1 is not exactly the turns' generated spans")
    return problems


def own_attempt(t: Mapping[str, Any], steps: Mapping[int, list[Mapping[str, Any]]]) -> dict[int, list[Mapping[str, Any]]]:
    """The steps events of the attempt that produced trajectory event `t`: those that started within its
    [started_at_ms, finished_at_ms] (one worker's clock stamps both). An attempt cut short by a crash or a
    rebalance published steps but no trajectory; the task's re-rollout, on newer weights, may end in fewer
    turns, and the abandoned attempt's later turns are none of its own."""
    lo, hi = t["started_at_ms"], t["finished_at_ms"]
    own = {turn: [s for s in candidates if lo <= s["started_at_ms"] <= hi] for turn, candidates in steps.items()}
    return {turn: candidates for turn, candidates in own.items() if candidates}


def _step_problems(t: Mapping[str, Any], steps: Mapping[int, list[Mapping[str, Any]]]) -> list[str]:
    """The trajectory's turns against the steps events of its own attempt (`own_attempt`): each turn's
    generated ids and log-probs are its step's output, in turn order. A turn may have several steps
    (redeliveries); one must match."""
    ids, lp = unpack_ids(t["input_ids"]), unpack_logprobs(t["rollout_logprobs"])
    problems = []
    for turn in t["turns"]:
        span = slice(turn["start"], turn["start"] + turn["length"])
        candidates = steps.get(turn["turn"], [])
        if not candidates:
            problems.append(f"no steps event for turn {turn['turn']}")
        elif not any(np.array_equal(unpack_ids(s["output_ids"]), ids[span])
                     and np.array_equal(unpack_logprobs(s["output_logprobs"]), lp[span])
                     and s["weight_version"] == turn["weight_version"] and s["pool"] == turn["pool"]
                     for s in candidates):
            problems.append(f"turn {turn['turn']}: tokens, log-probs, version or pool differ from its steps event")
    extra = sorted(set(steps) - {turn["turn"] for turn in t["turns"]})
    if extra:
        problems.append(f"steps events for turns {extra} that the trajectory does not have")
    return problems


def abandoned_steps(trajectories: list[Mapping[str, Any]], steps: list[Mapping[str, Any]]) -> int:
    """Steps events of a trajectory id that started within none of its trajectory events' attempts: the
    turns of attempts that never finished (a killed worker, a rebalance), re-rolled since."""
    windows: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for t in trajectories:
        windows[t["trajectory_id"]].append((t["started_at_ms"], t["finished_at_ms"]))
    return sum(1 for s in steps if s["trajectory_id"] in windows
               and not any(lo <= s["started_at_ms"] <= hi for lo, hi in windows[s["trajectory_id"]]))


def _check_trajectories(trajectories: list[Mapping[str, Any]], steps: list[Mapping[str, Any]],
                        not_checked: dict[str, int], settings: VerifySettings) -> list[CheckResult]:
    unique = CheckResult("trajectory_ids_unique", "no trajectory id carries two different contents rolled out on "
                         "the same weights (seeded sampling repeats a re-rollout token for token)")
    tito = CheckResult("token_invariants", "equal array lengths, num_tokens, prompt masked, log-prob 0 where "
                       "mask 0, mask 1 exactly on the turns' spans")
    matched = CheckResult("steps_match_trajectories", "each turn's tokens and log-probs are its steps event's output")
    first_on: dict[str, dict[tuple[int, ...], Mapping[str, Any]]] = defaultdict(dict)  # id -> versions -> first
    differing: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
    by_turn: dict[str, dict[int, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for s in steps:
        by_turn[s["trajectory_id"]][s["turn"]].append(s)
    for t in trajectories:
        tid = t["trajectory_id"]
        versions = tuple(u["weight_version"] for u in t["turns"])
        first = first_on[tid].setdefault(versions, t)
        if not same_content(first, t, settings.logprob_tolerance):
            differing[(tid, versions)] += 1
        if t["arrays_uri"] is not None:
            not_checked["offloaded_trajectories"] = not_checked.get("offloaded_trajectories", 0) + 1
            continue
        tito.checked += 1
        problems = token_problems(t)
        for p in problems:
            tito.fail(p, trajectory_id=tid, group_id=t["group_id"], member=t["member"])
        if tid in by_turn and not problems:
            matched.checked += 1
            for p in _step_problems(t, own_attempt(t, by_turn[tid])):
                matched.fail(p, trajectory_id=tid, group_id=t["group_id"], member=t["member"])
    # A re-rollout (after a crash, a rebalance) that ran on newer weights may differ: the group keeps
    # the first event (checked by group_members_match_trajectories), so training reads one content.
    unique.checked = len(first_on)
    for (tid, versions), n in differing.items():
        unique.fail(f"{n} copies differ from the first under one id on weight versions {list(versions)}",
                    trajectory_id=tid)
    rerolled = sum(1 for by_versions in first_on.values() if len(by_versions) > 1)
    if rerolled:
        not_checked["rerolled_on_newer_weights"] = rerolled
    if abandoned := abandoned_steps(trajectories, steps):
        not_checked["steps_of_abandoned_attempts"] = abandoned
    return [unique, tito, matched]


def with_referred_arrays(t: Mapping[str, Any], referable: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """A group member whose arrays stay in a `trajectories` event (arrays_uri kafka://...), with the
    arrays of that event put back; None when the event is not among those replayed. A member with
    its arrays inline (or in the object store) is returned as it is."""
    if not eventref.is_ref(t["arrays_uri"]):
        return t
    source = referable.get(t["arrays_uri"])
    if source is None:
        return None
    return {**t, **{k: source[k] for k in ("input_ids", "loss_mask", "rollout_logprobs", "arrays_uri")},
            "referred_trajectory_id": source["trajectory_id"]}


def _check_groups(groups: list[Mapping[str, Any]], first_trajectory: Mapping[str, Mapping[str, Any]],
                  referable: Mapping[str, Mapping[str, Any]], not_checked: dict[str, int],
                  s: VerifySettings) -> tuple[list[CheckResult], dict[str, float]]:
    """GRPO of every group event and its members against `trajectories`; returns the recomputed
    advantage of every member by trajectory id (from the first event of each group)."""
    adv = CheckResult("grpo_advantages", "each member's advantage, masked flag, and the group's reward "
                      "mean and std, recomputed from the members' rewards")
    same = CheckResult("group_members_match_trajectories", "each member, with the token arrays of the "
                       "trajectories event it refers to, equals the first trajectories event with its id")
    expected: dict[str, float] = {}
    seen: set[str] = set()
    for g in groups:
        gid, members = g["group_id"], g["members"]
        trajs = [m["trajectory"] for m in members]
        masked = [t["status"] == TASK_ERROR for t in trajs]
        values, mean, sd = grpo([t["reward"] for t in trajs], masked, s)
        if s.advantage == "none":  # the reward statistics are still the group's
            values = np.zeros(len(trajs))
        counted = [t["reward"] for t, m in zip(trajs, masked) if not m]
        if counted and not (_close(g["reward_mean"], float(np.mean(counted)), s.tolerance)
                            and _close(g["reward_std"], sd, s.tolerance)):
            adv.fail(f"reward mean/std {g['reward_mean']:.6g}/{g['reward_std']:.6g}, recomputed "
                     f"{np.mean(counted):.6g}/{sd:.6g}", group_id=gid)
        for m, t, is_masked, value in zip(members, trajs, masked, values):
            adv.checked += 1
            ids = {"group_id": gid, "trajectory_id": t["trajectory_id"], "member": t["member"]}
            if m["masked"] != is_masked:
                adv.fail(f"masked is {m['masked']} but status is {t['status']}", **ids)
            elif not _close(m["advantage"], float(value), s.tolerance):
                adv.fail(f"advantage {m['advantage']:.6g}, recomputed {value:.6g}", **ids)
            if gid not in seen:
                expected[t["trajectory_id"]] = float(value)
            first = first_trajectory.get(t["trajectory_id"])
            resolved = with_referred_arrays(t, referable)
            if resolved is None:
                not_checked["members_referring_to_events_not_replayed"] = \
                    not_checked.get("members_referring_to_events_not_replayed", 0) + 1
            elif resolved.get("referred_trajectory_id", t["trajectory_id"]) != t["trajectory_id"]:
                same.checked += 1
                same.fail(f"arrays_uri {t['arrays_uri']} is an event of trajectory "
                          f"{resolved['referred_trajectory_id']}", **ids)
            elif first is not None:
                same.checked += 1
                if not same_content(first, resolved, s.logprob_tolerance):
                    same.fail("differs from the trajectories event", **ids)
        seen.add(gid)
    return [adv, same], expected


def payload_missing(batch: Mapping[str, Any]) -> bool:
    """A claim-checked batch replayed without its stored object (expired or deleted): its items are
    unknown, while its own fields (index, group_ids, task_stats) are still the event's."""
    return batch["payload_uri"] is not None and not batch["items"]


def _check_batches(batches: list[Mapping[str, Any]], first_group: Mapping[str, Mapping[str, Any]],
                   expected_grpo: Mapping[str, float], s: VerifySettings) -> list[CheckResult]:
    members = CheckResult("batch_members", "a batch holds exactly the unmasked members of its groups, once each")
    group_adv = CheckResult("batch_group_advantages", "each item's GRPO advantage equals the one recomputed "
                            "from its group")
    final = CheckResult("task_normalized_advantages", "each item's final advantage and the per-task statistics, "
                        "recomputed by token-weighted standardization per task within the batch")
    for b in batches:
        bid, items = b["batch_id"], b["items"]
        trajs = [i["trajectory"] for i in items]
        listed = set(b["group_ids"])
        for gid in b["group_ids"]:
            g = first_group.get(gid)
            if g is None:
                continue
            members.checked += 1
            want = sorted(m["trajectory"]["trajectory_id"] for m in g["members"] if not m["masked"])
            got = sorted(t["trajectory_id"] for t in trajs if t["group_id"] == gid)
            if want != got:
                members.fail(f"items of group are {len(got)} trajectories, its unmasked members {len(want)}",
                             batch_id=bid, group_id=gid)
        for t in trajs:
            if t["group_id"] not in listed or t["validation"]:
                members.fail("item from a group the batch does not list, or a validation trajectory",
                             batch_id=bid, trajectory_id=t["trajectory_id"])
        for item, t in zip(items, trajs):
            if t["trajectory_id"] in expected_grpo:
                group_adv.checked += 1
                if not _close(item["group_advantage"], expected_grpo[t["trajectory_id"]], s.tolerance):
                    group_adv.fail(f"group_advantage {item['group_advantage']:.6g}, recomputed "
                                   f"{expected_grpo[t['trajectory_id']]:.6g}", batch_id=bid,
                                   trajectory_id=t["trajectory_id"])
        tasks, tokens = [t["task"] for t in trajs], [action_tokens(t) for t in trajs]
        values, stats = task_normalized([i["group_advantage"] for i in items], tasks, tokens, s)
        if not s.task_adv_norm:
            values = np.asarray([i["group_advantage"] for i in items], dtype=np.float64)
        values = values * np.asarray([s.task_advantage_scale.get(task, 1.0) for task in tasks], dtype=np.float64)
        for item, t, value in zip(items, trajs, values):
            final.checked += 1
            if not _close(item["advantage"], float(value), s.tolerance):
                final.fail(f"advantage {item['advantage']:.6g}, recomputed {value:.6g}", batch_id=bid,
                           trajectory_id=t["trajectory_id"], task=t["task"])
        recorded = {st["task"]: st for st in b["task_stats"]}
        for task, want in stats.items():
            got = recorded.get(task)
            if got is None or got["trajectories"] != want["trajectories"] or got["tokens"] != want["tokens"] \
                    or not _close(got["mean_before"], want["mean_before"], s.tolerance) \
                    or not _close(got["std_before"], want["std_before"], s.tolerance):
                final.fail(f"task_stats {got} disagree with recomputed {want}", batch_id=bid, task=task)
        for task in sorted(set(recorded) - set(stats)):
            final.fail("task_stats for a task with no item", batch_id=bid, task=task)
    return [members, group_adv, final]


def _check_weights(weights: list[Mapping[str, Any]]) -> list[CheckResult]:
    once = CheckResult("batches_trained_once", "no batch id in two weights events of different versions")
    continuous = CheckResult("learner_versions_continuous", "versions form one unbroken range, each with one batch")
    versions_of: dict[str, set[int]] = defaultdict(set)
    batches_of: dict[int, set[str | None]] = defaultdict(set)
    for w in weights:
        batches_of[w["version"]].add(w["batch_id"])
        if w["batch_id"] is not None:
            versions_of[w["batch_id"]].add(w["version"])
    once.checked = len(versions_of)
    for bid, versions in sorted(versions_of.items()):
        if len(versions) > 1:
            once.fail(f"trained into versions {sorted(versions)}", batch_id=bid)
    continuous.checked = len(batches_of)
    if batches_of:
        missing = sorted(set(range(min(batches_of), max(batches_of) + 1)) - set(batches_of))
        if missing:
            continuous.fail(f"versions {missing} missing between {min(batches_of)} and {max(batches_of)}")
    for version, bids in sorted(batches_of.items()):
        if len(bids) > 1:
            continuous.fail(f"announced with batches {sorted(bids, key=str)}", version=version)
    return [once, continuous]


def _check_groups_batched(groups: Mapping[str, Mapping[str, Any]], batches: list[Mapping[str, Any]]
                          ) -> tuple[CheckResult, list[str]]:
    """A training group not in any batch is lost once two batches were cut after it was ready (each
    cut takes every ready group but a rounding remainder, which the next cut takes first); with
    fewer, the run ended before it could train: pending."""
    lost = CheckResult("groups_reach_batches", "every training group is in a batch, unless pending at run end")
    batched = {gid for b in batches for gid in b["group_ids"]}
    cut_at = sorted({(b["batch_id"], b["created_at_ms"]) for b in batches}, key=lambda x: x[1])
    pending = []
    for gid, g in sorted(groups.items()):
        if g["validation"]:
            continue
        lost.checked += 1
        if gid in batched:
            continue
        later = sum(1 for _, at in cut_at if at > g["ready_at_ms"])
        if later >= 2:
            lost.fail(f"ready at {g['ready_at_ms']} but in none of the {later} batches cut since", group_id=gid)
        else:
            pending.append(gid)
    return lost, pending


_RUN_KEYED_TOPICS = (topics.TASKS_REQUESTED, topics.TASKS, topics.STEPS, topics.TRAJECTORIES, topics.GROUPS,
                     topics.BATCHES, topics.WEIGHTS)


def _dead_letters(records_by_topic: Mapping[str, Sequence[ReplayRecord]], run: str | None) -> dict[str, int]:
    """Dead letters in all, and those attributable to the run: a dead letter carries no run, so it is
    the run's when its original key is one of the run's keys (group, batch or run ids) on a topic
    keyed by them. Metrics and heartbeats are keyed by names shared across runs: never attributed."""
    letters = [r.value for r in records_by_topic.get(topics.DLQ, ())]
    keys = {r.key for t in _RUN_KEYED_TOPICS for r in records_by_topic.get(t, ()) if r.key is not None}
    if run is not None:
        keys.add(run.encode())
    ours = sum(1 for d in letters if d["source_topic"] in _RUN_KEYED_TOPICS and d["key"] in keys)
    return {"total": len(letters), "run": ours}


def verify(records_by_topic: Mapping[str, Sequence[ReplayRecord]], settings: VerifySettings | None = None, *,
           run: str | None = None, undecodable: Mapping[str, int] | None = None) -> VerifyReport:
    """Re-derives one run's advantages and invariants from its replayed events (already filtered to the
    run, except dlq) and reports every mismatch. `undecodable` (per topic) is reported as given."""
    s = settings or VerifySettings()
    values = {t: [r.value for r in recs] for t, recs in records_by_topic.items()}
    trajectories = values.get(topics.TRAJECTORIES, [])
    first_trajectory: dict[str, Mapping[str, Any]] = {}
    for t in trajectories:
        first_trajectory.setdefault(t["trajectory_id"], t)
    # the events groups and batches refer to for their members' token arrays (schemas/eventref.py)
    referable = {eventref.uri(topics.TRAJECTORIES, r.partition, r.offset): r.value
                 for r in records_by_topic.get(topics.TRAJECTORIES, [])}
    groups = values.get(topics.GROUPS, [])
    first_group: dict[str, Mapping[str, Any]] = {}
    for g in groups:
        first_group.setdefault(g["group_id"], g)
    batches = values.get(topics.BATCHES, [])
    not_checked: dict[str, int] = {}

    checks = _check_trajectories(trajectories, values.get(topics.STEPS, []), not_checked, s)
    group_checks, expected = _check_groups(groups, first_trajectory, referable, not_checked, s)
    checks += group_checks
    without_payload = sum(1 for b in batches if payload_missing(b))
    if without_payload:
        not_checked["batches_without_payload"] = without_payload
    checks += _check_batches([b for b in batches if not payload_missing(b)], first_group, expected, s)
    checks += _check_weights(values.get(topics.WEIGHTS, []))
    lost, pending = _check_groups_batched(first_group, batches)
    checks.append(lost)
    return VerifyReport(
        run=run, settings=s.model_dump(), counts={t: len(v) for t, v in sorted(values.items()) if t != topics.DLQ},
        dead_letters=_dead_letters(records_by_topic, run), undecodable=dict(undecodable or {}),
        not_checked=not_checked, pending_groups=pending, checks=checks)
