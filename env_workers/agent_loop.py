"""The token-in, token-out agent loop (ARCHITECTURE.md "The method"). Pure bookkeeping: the engine, the
environment, the engine picker, the clock and the sleep are passed in; no Kafka, no HTTP here.

The token record (input_ids, loss_mask, rollout log-probs) is append-only:
- the prompt is encoded once with the chat template (add_generation_prompt=True, tools passed);
- each turn sends the whole record so far to an engine and appends the ids it sampled with
  loss_mask 1 and the engine's log-probs;
- everything else (the template's closing of the turn, environment messages, parse-error
  messages) is appended as the difference of two chat-template encodings, loss_mask 0, log-prob 0.

Why re-encoding the final history reproduces input_ids exactly. The history keeps each
assistant turn as the *raw generated text* (its ids decoded, eos dropped, no tool_calls field);
the parsed message with tool_calls goes only to the environment. After each turn the loop
re-encodes the history and checks two things:
1. the encoding starts with the record as it was before the turn, else the template breaks the
   prefix property: TemplatePrefixError, a configuration error, raised after closing the session
   (unless a plain text in the turn's place keeps the prefix: then the sampled text itself merged
   with the template's text before it, and the turn is invalid output as in 2.);
2. it continues with exactly the sampled ids. It does not when the sampled ids are not the
   tokenizer's own encoding of their text: invalid UTF-8 (decoded lossily), a control tag spelled
   out byte by byte, a non-NFC string, or another segmentation of a BPE word (at temperature 0.8 a
   small BPE vocabulary samples one in most turns of a few dozen tokens). What then happens is
   `settings.noncanonical_turns`:
   - "keep" (default; AgentRL's token-in, token-out, seed 000 §3.2): the sampled ids stay in the
     record as sampled, followed by the template's closing of the turn (`closing`), and the
     trajectory goes on. The loop keeps `text_ids`, encode(history) at the turn boundary, beside
     the record; every later environment message is the difference of two encodings taken
     against `text_ids` and appended to both. The record is then encode(history) with each
     non-canonical turn's content replaced by the ids that were sampled for it.
   - "end": such a turn is not a valid message: the trajectory ends there with status
     agent_validation_failed (termination `invalid_output`), the sampled ids stay in the record
     with loss_mask 1 so the trajectory's reward trains against them.
   Either way the trajectory's `metrics["noncanonical_turns"]` counts such turns, and
   `metrics["noncanonical_valid_calls"]` those whose text parses into calls of the session's tools
   (under "end": actions the rule ended although their text is a well-formed call).
Otherwise the rest of the encoding (what the template writes after the content: eos if the
engine stopped on length, then the newline) is appended with loss_mask 0. At every turn boundary
`text_ids` equals encode(history), so each environment message's difference is taken against
it and, by induction, the final history re-encodes to `text_ids` (to input_ids when every turn
was canonical).

Statuses (env_workers.envs.base.Status): the environment's when it finishes the session
(completed, task_limit_reached, ...); task_limit_reached after max_turns; agent_context_limit when
the record cannot fit another turn or an environment answer within max_total_len; task_error when
the engines stay unreachable after retries or the environment raises (infrastructure: not
punished, masked out by the learner). A final status in `settings.punished_statuses` (by default
the turn and length limits) gets reward incomplete_punishment; any other keeps the environment's.

Behaviour (ARCHITECTURE.md "Metrics"): the trajectory's `metrics` also count its tool calls
(`parsed_calls`: those of its step events), the calls that repeat an earlier one of the
trajectory (`repeated_calls`: the same schemas.behaviour.call_signature) and the calls whose
arguments hold a dangerous command (`dangerous_calls`, and `dangerous_calls:<pattern>` per pattern
of schemas.behaviour). They are only counted: the policy's turn goes on exactly as without them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from env_workers.chat_template import ChatEncoder, TemplatePrefixError, bounded
from env_workers.engine_client import EngineError, Generation
from env_workers.envs.base import Status
from env_workers.settings import AgentLoopSettings
from env_workers.tool_parser import ParsedMessage, parse_error_message, parse_tool_calls
from env_workers.workload import new_tokens_cap, step_delay_s, turn_budget
from schemas.arrays import pack_ids, pack_logprobs, pack_mask
from schemas.behaviour import call_facts
from schemas.ids import trajectory_id

log = logging.getLogger(__name__)

CURRENT_POOL = "current"

# Why the loop stopped (the trajectory's `termination` field).
ENV_FINISHED = "env_finished"
MAX_TURNS = "max_turns"
MAX_TOTAL_LEN = "max_total_len"
ENGINE_ERROR = "engine_error"
ENV_ERROR = "env_error"
INVALID_OUTPUT = "invalid_output"


class Engine(Protocol):
    """One inference engine (env_workers.engine_client.EngineClient in production)."""

    engine_id: str

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float) -> Generation: ...


class Environment(Protocol):
    """env_workers.envs.base.Environment's lifecycle."""

    async def start(self, sample: Mapping[str, Any]) -> Any: ...
    async def observation(self, session: Any, assistant_message: Mapping[str, Any]) -> Any: ...
    async def end(self, session: Any) -> None: ...


# planned pool -> (pool actually used, engine). May fall back to the current pool; raises
# EngineError when no engine can take the turn.
PickEngine = Callable[[str], tuple[str, Engine]]


@dataclass
class Rollout:
    """A finished rollout: the trajectory and step events (schemas/avro/*.avsc shapes) and the final history."""

    trajectory: dict[str, Any]
    steps: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    error: str | None = None


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000.0))


@dataclass
class _Record:
    """The append-only token record."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)


@dataclass
class Ending:
    status: Status
    termination: str
    env_reward: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Sampled:
    """One turn's engine answer and where it went: known before the environment sees the turn."""

    turn: int
    planned_pool: str
    pool: str
    generation: Generation
    start: int
    """Length of the record before the turn: the prompt the engine got, and the turn's first position."""
    started: float
    """Wall time (s) the turn's engine call began."""
    generate_ms: float


@dataclass(frozen=True)
class TurnRecord:
    """One finished turn: its sampling and what it led to. The trajectory's `turns` entry and the
    `step` event (schemas/avro/step.avsc) are both read from it, so the two always agree."""

    sampled: Sampled
    env_status: Status
    finish: bool
    env_ms: float = 0.0
    parsed: ParsedMessage | None = None
    """The environment's view of the turn; None for invalid output, which is no message."""
    reward: float = 0.0
    env_tokens: int = 0
    """Tokens of the environment's answer appended after the turn (0 when none follows)."""

    def turn_entry(self) -> dict[str, Any]:
        """The trajectory's `turns` item."""
        s, generation = self.sampled, self.sampled.generation
        return {
            "turn": s.turn, "pool": s.pool, "engine_id": generation.engine_id,
            "weight_version": generation.weight_version, "start": s.start,
            "length": len(generation.token_ids), "generate_ms": s.generate_ms, "env_ms": self.env_ms,
        }

    def step_event(self, request: Mapping[str, Any], trajectory: str) -> dict[str, Any]:
        """The `step` event of the turn of `trajectory` (its id) rolled out for `request`."""
        s, generation = self.sampled, self.sampled.generation
        calls = self.parsed.tool_calls if self.parsed else []
        return {
            "run": request["run"], "trajectory_id": trajectory, "group_id": request["group_id"],
            "member": request["member"], "task": request["task"], "turn": s.turn,
            "planned_pool": s.planned_pool, "pool": s.pool, "engine_id": generation.engine_id,
            "weight_version": generation.weight_version, "prompt_tokens": s.start,
            "output_ids": pack_ids(generation.token_ids), "output_logprobs": pack_logprobs(generation.logprobs),
            "finish_reason": generation.finish_reason,
            "tool_calls": [{"name": c["function"]["name"], "arguments_json": c["function"]["arguments"]} for c in calls],
            "parse_error": self.parsed.error if self.parsed else None,
            "env_status": str(self.env_status), "reward": self.reward, "finish": self.finish,
            "env_tokens": self.env_tokens, "started_at_ms": _ms(s.started), "generate_ms": s.generate_ms,
            "env_ms": self.env_ms,
        }


class Loop:
    """State of one rollout (the token record, the history, the turns and step events, the metrics);
    `run_agent_loop` drives it against an environment, env_workers/proxy.py for an agent of its own."""

    def __init__(
        self,
        task: Mapping[str, Any],
        encoder: ChatEncoder,
        pick_engine: PickEngine,
        settings: AgentLoopSettings,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        on_step: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.task, self.request = task, task["request"]
        self.plan: list[str] = list(task.get("turn_pools") or [])
        self.encoder, self.pick_engine, self.settings = encoder, pick_engine, settings
        self.clock, self.sleep, self.on_step = clock, sleep, on_step
        self.id = trajectory_id(self.request["run"], self.request["group_id"], self.request["member"])
        self.shape = settings.family_workload(self.request["task"])  # a benchmark's workload, if any
        # the router's turn budget (streams.turn_schedule) and a benchmark's, never above this loop's own limit
        self.max_turns = min(settings.max_turns, task.get("max_turns") or settings.max_turns,
                             turn_budget(self.shape.turns, self.id, settings.max_turns))
        self.record = _Record()
        self.text_ids: list[int] = []
        """encode(history) at the last turn boundary: the record, but for sampled spans kept as sampled
        (`noncanonical_turns: keep`). Environment messages are differences of encodings taken against it."""
        self.history: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.prompt_tokens = 0
        self.turns: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.env_metrics: dict[str, float] = {}
        self.loop_metrics = {"parse_errors": 0.0, "engine_retries": 0.0, "pool_fallbacks": 0.0,
                             "noncanonical_turns": 0.0, "noncanonical_valid_calls": 0.0,
                             "parsed_calls": 0.0, "repeated_calls": 0.0, "dangerous_calls": 0.0}
        self.call_signatures: set[str] = set()
        """schemas.behaviour.call_signature of every tool call so far: a call among them is a repeat."""

    # --- one turn's engine call -----------------------------------------------------------------

    async def generate(self, planned: str, max_new: int, prompt_ids: Sequence[int] | None = None
                       ) -> tuple[str, Generation] | str:
        """(pool used, generation) after `prompt_ids` (default: the record), or the last error once retries
        are spent. The record is only read."""
        error = "no attempt"
        # the same prompt tokens on every retry, whatever an engine does
        prompt = tuple(self.record.ids if prompt_ids is None else prompt_ids)
        for attempt in range(self.settings.engine_retries + 1):
            try:
                pool, engine = self.pick_engine(planned)
                generation = await engine.generate(prompt, max_new, self.settings.temperature)
                count = len(generation.token_ids)
                if not 0 < count <= max_new or count != len(generation.logprobs):
                    # Checked here too: a bad answer must never reach the append-only record.
                    raise EngineError(f"{generation.engine_id}: malformed generation", engine_id=generation.engine_id)
                return pool, generation
            except EngineError as failure:
                error = str(failure)
                if not failure.retryable or attempt == self.settings.engine_retries:
                    break
                self.loop_metrics["engine_retries"] += 1
                log.warning("trajectory %s: engine error (attempt %d), retrying: %s", self.id, attempt + 1, failure)
                await self.sleep(self.settings.engine_retry_backoff_s * 2**attempt)
        return error

    # --- closing an assistant turn --------------------------------------------------------------

    def close_turn(self, generated: Sequence[int]) -> bool:
        """Appends the template's closing of the turn just generated; whether the sampled ids are the
        tokenizer's canonical encoding of their text (the record then equals encode(history) again)."""
        before = len(self.text_ids)
        rendered = self.encoder.encode(self.history, self.tools, add_generation_prompt=False)
        if rendered[:before] != self.text_ids:
            if not self.prefix_kept_with_other_content(before):
                raise TemplatePrefixError(
                    f"trajectory {self.id}: re-encoding the history with the new assistant turn changed the "
                    f"tokens before it; the chat template breaks the prefix property"
                )
            canonical = False  # the sampled text merged with the template's text before it (e.g. leading newlines)
        else:
            canonical = rendered[before:before + len(generated)] == list(generated)
        if canonical:
            self.record.add_context(rendered[before + len(generated):])
        elif self.settings.noncanonical_turns == "keep":
            self.record.add_context(self.closing(generated))
        else:
            return False
        self.text_ids = rendered
        return canonical

    def closing(self, generated: Sequence[int]) -> list[int]:
        """What the template writes after an assistant turn's content, less the eos the engine already sampled.
        The close begins with a control token (Qwen's <|im_end|>), so no BPE merge joins it to the content."""
        close = list(self.encoder.assistant_close)
        return close[1:] if generated and generated[-1] == self.encoder.eos_token_id and close[:1] == [generated[-1]] else close

    def prefix_kept_with_other_content(self, before: int) -> bool:
        """Whether the record's first `before` tokens survive when the last assistant turn says
        something plain: then the template keeps the prefix property and it was the sampled text
        that broke it (with BPE merges, text can merge with what the template wrote before it)."""
        plain = [*self.history[:-1], {"role": "assistant", "content": "ok"}]
        return self.encoder.encode(plain, self.tools, add_generation_prompt=False)[:before] == self.text_ids

    # --- events ---------------------------------------------------------------------------------

    def add_turn(self, record: TurnRecord) -> None:
        self.turns.append(record.turn_entry())
        step = record.step_event(self.request, self.id)
        self.count_calls(step["tool_calls"])
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)

    def count_calls(self, calls: Sequence[Mapping[str, str]]) -> None:
        """Counts a turn's tool calls (the step event's, so the trajectory's counts and its steps
        agree): all of them, those repeating an earlier call of the trajectory (a tool-call loop
        repeats the same call), and those whose arguments hold a dangerous command, in total and
        per pattern (`dangerous_calls:<pattern>`, only once one is seen: most trajectories have none).
        Only counted: the environment still runs every call, and its sandbox is what contains them."""
        for call in calls:
            signature, pattern = call_facts(call["name"], call["arguments_json"])
            self.loop_metrics["parsed_calls"] += 1
            if signature in self.call_signatures:
                self.loop_metrics["repeated_calls"] += 1
            self.call_signatures.add(signature)
            if pattern is not None:
                self.loop_metrics["dangerous_calls"] += 1
                key = f"dangerous_calls:{pattern}"
                self.loop_metrics[key] = self.loop_metrics.get(key, 0.0) + 1

    def count_valid_calls(self, parsed: ParsedMessage) -> None:
        """Counts a non-canonical turn whose text parses into calls of the session's tools."""
        known = {tool["function"]["name"] for tool in self.tools}
        calls = parsed.tool_calls
        if parsed.error is None and calls and all(c["function"]["name"] in known for c in calls):
            self.loop_metrics["noncanonical_valid_calls"] += 1

    # --- the loop -------------------------------------------------------------------------------

    async def sample_turn(self, turn: int, room: int) -> Sampled | str:
        """Generates turn `turn` within `room` tokens and appends it to the record and the history;
        the last engine error once retries are spent."""
        planned = self.plan[turn] if turn < len(self.plan) else CURRENT_POOL
        started = self.clock()
        cap = new_tokens_cap(self.shape.new_tokens, self.id, turn, self.settings.max_new_tokens)
        result = await self.generate(planned, min(cap, room))
        generate_ms = (self.clock() - started) * 1000.0
        if isinstance(result, str):
            return result
        pool, generation = result
        if pool != planned:
            self.loop_metrics["pool_fallbacks"] += 1
        sampled = Sampled(turn, planned, pool, generation, len(self.record.ids), started, generate_ms)
        self.record.add_generated(generation.token_ids, generation.logprobs)
        self.history.append({"role": "assistant", "content": self.content_text(generation.token_ids)})
        return sampled

    def content_text(self, ids: Sequence[int]) -> str:
        """A sampled turn's text as the history holds it: its ids decoded without the closing eos."""
        return self.encoder.decode(ids[:-1] if ids and ids[-1] == self.encoder.eos_token_id else ids)

    async def turns_until_end(self, env: Environment, session: Any) -> Ending:
        settings = self.settings
        reserve = len(self.encoder.assistant_close)
        for turn in range(self.max_turns):
            room = settings.max_total_len - len(self.record.ids) - reserve
            if room <= 0:
                return Ending(Status.AGENT_CONTEXT_LIMIT, MAX_TOTAL_LEN)
            sampled = await self.sample_turn(turn, room)
            if isinstance(sampled, str):
                return Ending(Status.TASK_ERROR, ENGINE_ERROR, error=sampled)
            if self.shape.step_latency.enabled:  # a benchmark's slow environment, paid on every turn
                await self.sleep(step_delay_s(self.shape.step_latency, self.id, turn))

            parsed = parse_tool_calls(self.history[-1]["content"], call_id_prefix=f"call_{turn}")
            if not self.close_turn(sampled.generation.token_ids):
                self.loop_metrics["noncanonical_turns"] += 1
                self.count_valid_calls(parsed)
                if settings.noncanonical_turns == "end":  # the step records no parse: the turn is not a message
                    self.add_turn(TurnRecord(sampled, Status.AGENT_VALIDATION_FAILED, finish=True))
                    return Ending(Status.AGENT_VALIDATION_FAILED, INVALID_OUTPUT)

            env_started = self.clock()
            if parsed.error is not None:
                self.loop_metrics["parse_errors"] += 1
                new_messages, status = [parse_error_message(parsed.error)], Status.RUNNING
                reward, finish = 0.0, False
            else:
                try:
                    observation = await env.observation(session, parsed.as_openai())
                    status = Status(observation.status)  # a status outside the enum is the environment's bug
                except Exception as error:  # the environment broke, not the policy
                    log.exception("trajectory %s: environment failed", self.id)
                    self.add_turn(TurnRecord(sampled, Status.TASK_ERROR, finish=True, parsed=parsed,
                                             env_ms=(self.clock() - env_started) * 1000.0))
                    return Ending(Status.TASK_ERROR, ENV_ERROR, error=repr(error))
                self.env_metrics = {k: float(v) for k, v in observation.metrics.items()}
                # Bounded before anything encodes them (control tokens, invalid text: ChatEncoder.encode).
                new_messages = [dict(bounded(m, settings.max_env_output_chars)) for m in observation.messages]
                reward, finish = float(observation.reward), bool(observation.finish)
            outcome = partial(TurnRecord, sampled, status, env_ms=(self.clock() - env_started) * 1000.0,
                              parsed=parsed, reward=reward)

            if finish:
                self.add_turn(outcome(finish=True))
                return Ending(status, ENV_ERROR if status == Status.TASK_ERROR else ENV_FINISHED, env_reward=reward)
            if turn == self.max_turns - 1:
                # No turn follows: the policy would never read the answer, so it is not recorded.
                self.add_turn(outcome(finish=False))
                return Ending(Status.TASK_LIMIT_REACHED, MAX_TURNS)
            delta = self.encoder.extension(self.text_ids, [*self.history, *new_messages], self.tools, True)
            if len(self.record.ids) + len(delta) > settings.max_total_len:
                self.add_turn(outcome(finish=False))
                return Ending(Status.AGENT_CONTEXT_LIMIT, MAX_TOTAL_LEN)
            self.record.add_context(delta)
            self.text_ids += delta
            self.history.extend(new_messages)
            self.add_turn(outcome(finish=False, env_tokens=len(delta)))
        return Ending(Status.TASK_LIMIT_REACHED, MAX_TURNS)

    def trajectory(self, ending: Ending, worker_id: str, started: float, finished: float) -> dict[str, Any]:
        request = self.request
        punished = ending.status in self.settings.punished_statuses  # never completed or task_error
        reward = self.settings.incomplete_punishment if punished else ending.env_reward
        metrics = {**self.env_metrics, **self.loop_metrics}
        score = metrics.get("score")
        return {
            "trajectory_id": self.id, "run": request["run"], "group_id": request["group_id"],
            "member": request["member"], "group_size": request["group_size"], "task": request["task"],
            "split": request["split"], "sample_index": request["sample_index"],
            "validation": bool(request.get("validation", False)),
            "input_ids": pack_ids(self.record.ids), "loss_mask": pack_mask(self.record.mask),
            "rollout_logprobs": pack_logprobs(self.record.logprobs), "arrays_uri": None,
            "num_tokens": len(self.record.ids), "prompt_tokens": self.prompt_tokens, "turns": self.turns,
            "status": str(ending.status), "reward": float(reward), "env_reward": float(ending.env_reward),
            "termination": ending.termination, "template_fingerprint": self.encoder.fingerprint,
            "worker_id": worker_id, "started_at_ms": _ms(started), "finished_at_ms": _ms(finished),
            "score": score, "metrics": metrics,
        }


async def run_agent_loop(
    task: Mapping[str, Any],
    sample: Mapping[str, Any],
    env: Environment,
    encoder: ChatEncoder,
    pick_engine: PickEngine,
    settings: AgentLoopSettings,
    *,
    worker_id: str,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> Rollout:
    """Rolls out one task member (a `tasks` event: request + turn_pools) in `env` to the end.

    `clock` is wall time in seconds (time.time in production). `on_step` sees each step event as
    its turn finishes. Never raises for policy, engine or environment failures; raises
    TemplatePrefixError for a chat template the loop cannot use, after closing the session.
    """
    loop = Loop(task, encoder, pick_engine, settings, clock, sleep, on_step)
    started = clock()
    session = None
    try:
        try:
            session = await env.start(sample)
        except Exception as error:
            log.exception("trajectory %s: environment failed to start", loop.id)
            ending = Ending(Status.TASK_ERROR, ENV_ERROR, error=repr(error))
        else:
            loop.history, loop.tools = list(session.messages), list(session.tools)
            prompt = encoder.encode(loop.history, loop.tools, add_generation_prompt=True)
            loop.record.add_context(prompt)
            loop.text_ids = list(prompt)
            loop.prompt_tokens = len(prompt)
            ending = await loop.turns_until_end(env, session)
    finally:
        if session is not None:
            try:
                await env.end(session)
            except Exception:  # end() is documented safe; a failure to release must not lose the trajectory
                log.exception("trajectory %s: environment end() failed", loop.id)
    trajectory = loop.trajectory(ending, worker_id, started, clock())
    return Rollout(trajectory, loop.steps, loop.history, loop.tools, ending.error)
