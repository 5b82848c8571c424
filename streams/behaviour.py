"""Behaviour figures of a task's rollouts: how the policy acts, beside how well it scores. Pure
counting over `step` and `trajectory` events (plain dicts as schemas/avro defines them), shared by
the metrics agent (streams/metrics_agent.py, which keeps the counters in its table) and the run
report (pipeline/analysis/report.py, which folds a finished run's events).

The counters are flat numbers that add up across partitions and workers (aggregation.tally), so a
table row stays small whatever the run's length: no per-trajectory state. Everything that needs
one trajectory's history (repeated calls, dangerous calls) is counted by the agent loop into the
trajectory's `metrics` and only summed here.

The figures (`figures`), per task:
- invalid_output_share: steps whose text did not parse into tool calls (`parse_error`) / steps;
- truncation_share: steps the engine stopped at max tokens (`finish_reason` length) / steps;
- response_tokens_per_step: generated tokens per step;
- mean_token_nll: the mean negative log-prob of the sampled tokens under the engine that sampled
  them. The expected -log p of a sampled token is the policy's entropy at that position, so this
  is a per-token entropy estimate (of the sampling distribution: temperature included); a
  collapse towards 0 warns of a policy that stopped exploring;
- calls, call_success_rate and `tools` ({tool: {calls, success_rate}}): tool calls of the steps
  and the share that succeeded, by `call_succeeded`'s rule;
- tool_error_share: the environments' own count of calls that failed, those they refused (an
  unknown tool, arguments that do not fit: `refused_calls`) and well-formed ones the task rejected
  (`tool_errors`), / the calls they received (`tool_calls`), from the trajectories' metrics;
- repeated_call_share: calls repeating an earlier call of their trajectory / calls, and
  dangerous_calls, dangerous_by_pattern: calls whose arguments hold a dangerous command
  (schemas/behaviour.py), from the trajectories' metrics.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from schemas.arrays import unpack_ids, unpack_logprobs
from schemas.behaviour import PATTERN_NAMES
from schemas.status import Status
from streams import aggregation

FAILED_CALL_STATUSES = frozenset({Status.AGENT_INVALID_ACTION, Status.AGENT_VALIDATION_FAILED, Status.TASK_ERROR})
"""A step's calls failed when its env_status is one of these. Why only these: a step carries one
status for the whole turn, and env_workers.envs.base keeps a session `running` after a malformed
call or one the task rejects (the policy sees an error message; the environment counts them in its
`malformed_calls` and `tool_errors` metrics). So the status marks only the failures that end the
session: an invalid action (alfworld's repeated action), invalid output (the loop ends such a turn
without calls) and an environment crash on the call (task_error). tool_error_share counts the
rejected calls the status cannot see."""

MAX_TOOLS_PER_ROW = 32
"""Distinct tool names kept per counter row; later new names count as OTHER_TOOL. Tool names
come from the policy's text, so a policy inventing names must not grow a table row without end."""
OTHER_TOOL = "<other>"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""A name the counters keep as written (every family's tools look like this); any other is OTHER_TOOL."""

# Counter names. Per-tool and per-pattern counters are "<prefix><name>".
STEPS = "steps"
INVALID_OUTPUTS = "invalid_outputs"
TRUNCATED_STEPS = "truncated_steps"
RESPONSE_TOKENS = "response_tokens"
NLL_SUM = "nll_sum"
CALLS = "calls"
TOOL_CALLS = "tool_calls:"
TOOL_OK = "tool_ok:"
TRAJECTORY_CALLS = "trajectory_calls"
REPEATED_CALLS = "repeated_calls"
DANGEROUS_CALLS = "dangerous_calls"
DANGEROUS = "dangerous:"
ENV_TOOL_CALLS = "env_tool_calls"
ENV_TOOL_ERRORS = "env_tool_errors"

FIGURES = ("invalid_output_share", "truncation_share", "response_tokens_per_step", "mean_token_nll",
           "call_success_rate", "tool_error_share", "repeated_call_share", "dangerous_calls")
"""The per-task figures of `figures` that are one number each: what the metrics agent publishes as
`streams/<figure>` and what an alert rule may watch (streams/alerts.py)."""


def call_succeeded(env_status: str) -> bool:
    """Whether the calls of a step with this env_status succeeded (FAILED_CALL_STATUSES says why so few fail)."""
    return env_status not in FAILED_CALL_STATUSES


def tool_label(name: str, known: Iterable[str]) -> str:
    """The name a call of `name` is counted under, given the names a row already counts."""
    if _TOOL_NAME.fullmatch(name) is None:
        return OTHER_TOOL
    known = set(known)
    return name if name in known or len(known) < MAX_TOOLS_PER_ROW else OTHER_TOOL


def count_step(counters: Mapping[str, Any], step: Mapping[str, Any]) -> dict[str, Any]:
    """The counters with one step and its behaviour added (`steps` too: the metrics agent's row shares the key)."""
    logprobs = unpack_logprobs(step["output_logprobs"])
    # A non-finite log-prob (an engine's -inf) would make the sum useless for the rest of the run.
    finite = logprobs[np.isfinite(logprobs)]
    counts: dict[str, float] = {
        STEPS: 1,
        INVALID_OUTPUTS: int(step["parse_error"] is not None),
        TRUNCATED_STEPS: int(step["finish_reason"] == "length"),
        RESPONSE_TOKENS: len(unpack_ids(step["output_ids"])),
        NLL_SUM: -float(finite.sum(dtype=np.float64)),
        CALLS: len(step["tool_calls"]),
    }
    ok = int(call_succeeded(step["env_status"]))
    known = [k[len(TOOL_CALLS):] for k in counters if k.startswith(TOOL_CALLS)]
    for call in step["tool_calls"]:
        tool = tool_label(call["name"], known)
        known.append(tool)
        counts[TOOL_CALLS + tool] = counts.get(TOOL_CALLS + tool, 0) + 1
        counts[TOOL_OK + tool] = counts.get(TOOL_OK + tool, 0) + ok
    return aggregation.tally(counters, counts)


def count_trajectory(counters: Mapping[str, Any], trajectory: Mapping[str, Any]) -> dict[str, Any]:
    """The counters with one trajectory's call metrics added (those of the agent loop and of the
    environment; a trajectory without them, e.g. an environment that failed to start, adds 0)."""
    metrics = trajectory.get("metrics") or {}
    counts: dict[str, float] = {
        TRAJECTORY_CALLS: metrics.get("parsed_calls", 0.0), REPEATED_CALLS: metrics.get("repeated_calls", 0.0),
        DANGEROUS_CALLS: metrics.get("dangerous_calls", 0.0), ENV_TOOL_CALLS: metrics.get("tool_calls", 0.0),
        # A call the environment refused (unknown tool, bad arguments) failed as surely as one the task rejected.
        ENV_TOOL_ERRORS: metrics.get("tool_errors", 0.0) + metrics.get("refused_calls", 0.0),
    }
    for pattern in PATTERN_NAMES:  # only the declared names: the map may hold anything an environment wrote
        n = metrics.get(f"dangerous_calls:{pattern}", 0.0)
        if n:
            counts[DANGEROUS + pattern] = n
    return aggregation.tally(counters, counts)


def per_task(steps: Iterable[Mapping[str, Any]],
             trajectories: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{task: counters} of a set of events (a finished run's, for the report), `steps` included."""
    out: dict[str, dict[str, Any]] = {}
    for s in steps:
        out[s["task"]] = count_step(out.get(s["task"], {}), s)
    for t in trajectories:
        out[t["task"]] = count_trajectory(out.get(t["task"], {}), t)
    return dict(sorted(out.items()))


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def figures(c: Mapping[str, Any]) -> dict[str, Any]:
    """The behaviour figures of one task's counters (the module docstring defines each); a share
    whose denominator is 0 is None."""
    steps, tokens, calls = c.get(STEPS, 0), c.get(RESPONSE_TOKENS, 0), c.get(CALLS, 0)
    tools = {key[len(TOOL_CALLS):]: n for key, n in sorted(c.items()) if key.startswith(TOOL_CALLS)}
    return {
        "steps": steps,
        "invalid_output_share": _share(c.get(INVALID_OUTPUTS, 0), steps),
        "truncation_share": _share(c.get(TRUNCATED_STEPS, 0), steps),
        "response_tokens_per_step": _share(tokens, steps),
        "mean_token_nll": _share(c.get(NLL_SUM, 0.0), tokens),
        "calls": calls,
        "call_success_rate": _share(sum(c.get(TOOL_OK + tool, 0) for tool in tools), calls),
        "tools": {tool: {"calls": n, "success_rate": _share(c.get(TOOL_OK + tool, 0), n)} for tool, n in tools.items()},
        "tool_error_share": _share(c.get(ENV_TOOL_ERRORS, 0.0), c.get(ENV_TOOL_CALLS, 0.0)),
        "repeated_call_share": _share(c.get(REPEATED_CALLS, 0.0), c.get(TRAJECTORY_CALLS, 0.0)),
        "dangerous_calls": int(c.get(DANGEROUS_CALLS, 0)),
        "dangerous_by_pattern": {p: int(c[DANGEROUS + p]) for p in PATTERN_NAMES if c.get(DANGEROUS + p)},
    }
