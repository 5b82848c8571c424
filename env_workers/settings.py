"""Settings of the rollout side's agent loop (ARCHITECTURE.md "The method": token-in, token-out loop)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from env_workers.envs.base import Status
from env_workers.envs.registry import FAMILY_MODULES
from env_workers.workload import FamilyWorkload, StepLatency

LIMIT_STATUSES: tuple[Status, ...] = (Status.AGENT_CONTEXT_LIMIT, Status.TASK_LIMIT_REACHED)
"""The turn or length limit reached without completion: the default of `punished_statuses`."""

WIDE_PUNISHED_STATUSES: tuple[Status, ...] = tuple(sorted(set(Status) - {Status.COMPLETED, Status.TASK_ERROR}))
"""Every status but completed and task_error: AgentRL code's rule (any status but completed) less task_error."""

# Never punished: completed is success, task_error an infrastructure failure masked out of training.
_NEVER_PUNISHED = frozenset({Status.COMPLETED, Status.TASK_ERROR})


class AgentLoopSettings(BaseModel):
    """Limits, sampling and failure handling of one multi-turn rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(20, ge=1)
    """AgentRL max_turns 20: assistant turns before the session ends as task_limit_reached."""
    max_total_len: int = Field(8192, ge=16)
    """AgentRL max_total_len 8192: tokens of the whole trajectory (prompt, turns, environment messages)."""
    max_new_tokens: int = Field(1024, ge=1)
    """AgentRL per-turn generation cap 1024 (min'ed with what max_total_len leaves)."""
    temperature: float = Field(0.8, gt=0.0)
    """AgentRL rollout temperature 0.8."""
    incomplete_punishment: float = -0.2
    """AgentRL incomplete_punishment -0.2 (AgentRL's code names the setting and reads it from the task config, 0
    when unset): the reward of a trajectory whose final status is in `punished_statuses`."""
    punished_statuses: tuple[Status, ...] = LIMIT_STATUSES
    """Final statuses that get `incomplete_punishment`; any other keeps the environment's reward (0 for a failure).
    Default, ours: the turn or length limit reached without completion, task_limit_reached (max_turns or a
    family's round limit) and agent_context_limit. AgentRL's code punishes more: its agent loop replaces the
    reward by incomplete_punishment whenever the final status is not "completed". `WIDE_PUNISHED_STATUSES` is
    that rule less task_error; in YAML: `punished_statuses: [agent_context_limit, agent_invalid_action,
    agent_validation_failed, cancelled, running, task_limit_reached, unknown]`. completed and task_error are
    refused."""
    noncanonical_turns: Literal["keep", "end"] = "keep"
    """What a turn whose sampled ids are not the tokenizer's canonical encoding of their text does (another
    segmentation of a BPE word, a control tag spelled byte by byte, text that merged with the template's).
    "keep": AgentRL's token-in, token-out (seed 000 §3.2): the sampled ids stay the record, as sampled and
    trained on, and the environment's answer is the template's difference appended after them; the
    trajectory goes on. "end": the turn is invalid output and the trajectory ends as agent_validation_failed
    (this project's rule before; measured to end 97% of the six-family SFT policy's db/os/kg/webshop
    trajectories on their first turn, docs/RESULTS.md)."""
    engine_retries: int = Field(3, ge=0)
    """Not in the paper: retries of one turn's engine call (same prompt tokens) before the trajectory is a task_error."""
    engine_retry_backoff_s: float = Field(0.5, ge=0.0)
    """Not in the paper: first retry delay, doubled at each further retry."""
    engine_timeout_s: float = Field(600.0, gt=0.0)
    """Not in the paper: one completion request's timeout (1024 tokens on a busy CPU engine take minutes)."""
    engine_api_key: SecretStr | None = None
    """Not in the paper: the key engines require on their OpenAI routes (vLLM's --api-key; `rollstream engine` gives
    it to its server), sent by every caller as a bearer token. None: engines are open, and reachable from this
    host only unless engines.bind_host says otherwise. Set it from the environment: ROLLSTREAM_AGENT_LOOP__ENGINE_API_KEY."""
    max_env_output_chars: int = Field(32_768, ge=64)
    """Not in the paper: characters of one environment message the policy sees; a longer one keeps its head and a
    note of how much was cut (env_workers/chat_template.bounded). 4 x max_total_len: at about 4 characters a
    token, a longer answer could never fit the context and would only cost tokenizing every turn."""
    step_latency: StepLatency = StepLatency()
    """Not in the paper: delay added to every environment step, for benchmarks (off by default)."""
    workload: tuple[FamilyWorkload, ...] = ()
    """Not in the paper: a benchmark's shape per family (env_workers/workload.py): its own step latency, a
    heavy-tailed turn budget per trajectory and cap on each turn's new tokens. Empty (default): none."""

    @field_validator("workload")
    @classmethod
    def _known_families_once(cls, workload: tuple[FamilyWorkload, ...]) -> tuple[FamilyWorkload, ...]:
        names = [shape.family for shape in workload]
        unknown = sorted(set(names) - set(FAMILY_MODULES))
        if unknown:
            raise ValueError(f"no family {', '.join(unknown)} (families: {', '.join(sorted(FAMILY_MODULES))})")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"family {', '.join(twice)} has more than one workload shape")
        return workload

    def family_workload(self, family: str) -> FamilyWorkload:
        """`family`'s shape, its step latency filled in from step_latency when it sets none."""
        shape = next((s for s in self.workload if s.family == family), FamilyWorkload(family=family))
        return shape if shape.step_latency else shape.model_copy(update={"step_latency": self.step_latency})

    @field_validator("punished_statuses")
    @classmethod
    def _a_set_of_failures(cls, statuses: tuple[Status, ...]) -> tuple[Status, ...]:
        refused = sorted(_NEVER_PUNISHED.intersection(statuses))
        if refused:
            raise ValueError(f"{', '.join(refused)} cannot be punished: completed is success, task_error an "
                             f"infrastructure failure masked out of training")
        return tuple(sorted(set(statuses)))  # one spelling per set: equal settings compare (and hash) equal
