"""ROLL's two rules for training data, checked through the environment API itself.

Every task runs twice: once with the family's golden policy (it must succeed) and once with its
no-op policy (it must not). A task that breaks either rule is unfit for training. Success means
the session completed with reward 1 (full credit); an infrastructure failure (`task_error`, or a
task that cannot start) is counted in `errors` and fails the golden rule.

A sample may be a perturbed variant of a task (it carries `variant: {name, kind, ...}`, see
os_variants.py): its id names the variant, and the result then also counts each rule per variant
kind (`variants`), so a kind of perturbation that breaks its tasks shows as such.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from env_workers.envs.base import Environment, Family, Observation, Policy, Status, TaskError

FULL_CREDIT = 1.0


@dataclass(frozen=True)
class Episode:
    """How one policy fared on one task."""

    status: Status
    reward: float
    rounds: int

    @property
    def success(self) -> bool:
        return self.status == Status.COMPLETED and self.reward >= FULL_CREDIT


async def run_episode(env: Environment, sample: Mapping[str, Any], policy: Policy) -> Episode:
    """Plays one session to its end (the round limit bounds it) and always releases it."""
    try:
        session = await env.start(sample)
    except TaskError:
        return Episode(Status.TASK_ERROR, 0.0, 0)
    try:
        history = list(session.messages)
        observation: Observation | None = None
        while observation is None or not observation.finish:
            message = policy(history)
            observation = await env.observation(session, message)
            history += [message, *observation.messages]
        return Episode(observation.status, observation.reward, session.rounds)
    finally:
        await env.end(session)


async def check_family(
    family: Family,
    env: Environment,
    samples: Iterable[Mapping[str, Any]],
    on_task: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """{family, tasks, golden_pass, noop_pass, errors, failing_ids} over the samples, in order; with
    `variants` ({kind: {tasks, golden_pass, noop_pass, errors}}) when any sample is a variant."""
    totals = _counts()
    by_kind: dict[str, dict[str, int]] = {}
    failing_ids: list[str] = []
    for sample in samples:
        golden = await run_episode(env, sample, family.golden(sample))
        noop = await run_episode(env, sample, family.noop(sample))
        groups = [totals]
        if sample.get("variant"):
            groups.append(by_kind.setdefault(str(sample["variant"]["kind"]), _counts()))
        for counts in groups:
            counts["tasks"] += 1
            counts["golden_pass"] += golden.success
            counts["noop_pass"] += noop.success
            counts["errors"] += (golden.status == Status.TASK_ERROR) + (noop.status == Status.TASK_ERROR)
        if not golden.success or noop.success:
            failing_ids.append(str(sample["id"]))
        on_task()
    result: dict[str, Any] = {"family": family.name, **totals, "failing_ids": failing_ids}
    if by_kind:
        result["variants"] = dict(sorted(by_kind.items()))
    return result


def _counts() -> dict[str, int]:
    return {"tasks": 0, "golden_pass": 0, "noop_pass": 0, "errors": 0}
