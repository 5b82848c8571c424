"""The recording proxy's logic (`rollstream proxy`, ARCHITECTURE.md "The recording proxy"): an agent
written by anyone, speaking the OpenAI chat-completions API, rolls out an episode; the proxy applies
the policy's chat template itself, samples token ids through the run's engines, and records every call
in the agent loop's own token record (env_workers/agent_loop.py `Loop`), so the `steps` and
`trajectory` events are the ones the built-in loop writes. Pure: the engine picker, the clock, the
sleep and the event sinks are passed in; no HTTP (env_workers/proxy_server.py) and no Kafka here.

The protocol, per episode:
- `open_episode` (POST /episodes): the caller names the task member (task, split, sample_index, member,
  group_size, epoch, validation); the episode id is its deterministic trajectory id.
- `Episode.complete` (POST /episodes/{id}/v1/chat/completions): the first call's messages and tools are
  the prompt (encoded once, loss_mask 0); each call samples one assistant turn (loss_mask 1, the engine's
  log-probs) and answers it in OpenAI shape, tool calls parsed by env_workers/tool_parser.py.
- A later call must continue the conversation: its messages start with the messages recorded so far,
  the proxy's own answers included (as the client returned them), followed by what the environment said.
  That part is appended as the difference of two chat-template encodings (loss_mask 0), exactly as the
  agent loop appends an environment's answer, and the previous turn's `step` event is sent.
- `Episode.finish` (POST /episodes/{id}/end): the caller's reward and status close the episode; the last
  turn's step and the trajectory are sent (the agent loop's punishment rule applies to the status).

Re-encoding. The proxy keeps each of its answers as the raw sampled text (the agent loop's history) and
maps an assistant message of a request that equals one it served back to that text. A request that does
not continue the record (an edited, dropped or reordered message, a truncated context, other tools, the
same call asked again) or whose encoding does not start with the recorded tokens is a re-encoding
mismatch, counted in `metrics["reencode_mismatches"]`; ProxySettings.reencode_mismatch decides: "prefix"
keeps the record as it was (later calls are served from the agent's own history, unrecorded, counted in
`metrics["unrecorded_calls"]`), "drop" publishes the episode as task_error (masked out of its group).

Everything a caller sends is hostile input: a bad request raises RequestError, one line, which the
server turns into an HTTP 400 with an OpenAI error body. Model output is parsed, never trusted.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from env_workers.agent_loop import (
    CURRENT_POOL, ENGINE_ERROR, ENV_FINISHED, INVALID_OUTPUT, MAX_TOTAL_LEN, MAX_TURNS, Ending, Loop, PickEngine,
    Sampled, TurnRecord,
)
from env_workers.chat_template import ChatEncoder, TemplatePrefixError
from env_workers.envs.base import Status
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from env_workers.tool_parser import ParsedMessage, parse_tool_calls
from schemas.ids import group_id, trajectory_id

REENCODE_MISMATCH = "reencode_mismatch"
"""Termination of an episode dropped for a re-encoding mismatch (status task_error)."""
NO_CALLS = "no_calls"
"""Termination of an episode ended before any call was recorded (status task_error)."""
IDLE_TIMEOUT = "idle_timeout"
"""Termination of an episode its caller left idle longer than ProxySettings.idle_timeout_s (status task_error)."""

ROLES = ("system", "user", "assistant", "tool")
CALLER_STATUSES = (Status.COMPLETED, Status.TASK_LIMIT_REACHED, Status.AGENT_CONTEXT_LIMIT,
                   Status.AGENT_VALIDATION_FAILED, Status.AGENT_INVALID_ACTION, Status.TASK_ERROR)
"""Final statuses a caller may report (ARCHITECTURE.md "Statuses"); running, cancelled and unknown are not endings."""
_MAX_ID_CHARS = 200


class RequestError(ValueError):
    """A bad request: its one-line message goes back as an HTTP 400 (or `status`) OpenAI error."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.code, self.param, self.status = code, param, status


class EngineUnavailable(RuntimeError):
    """No engine answered the turn after the agent loop's retries: HTTP 503; the episode ends as task_error."""


def error_body(message: str, code: str = "invalid_request", param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


# --- requests ---------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts (OpenAI's content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                   param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts", param=f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)):
            raise RequestError(f"{where}.tool_calls[{i}] must be {{\"id\", \"type\": \"function\", \"function\": "
                               f"{{\"name\": string, \"arguments\": string}}}}", param=f"{where}.tool_calls")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "")}})
    return out


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    """One request message in the shape the chat template and the environments use; RequestError when bad."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}",
                           param=f"{where}.role")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
    return out


def _tool(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": ...}}}}", param="tools")
    if not isinstance(function.get("parameters", {}), dict):
        raise RequestError(f"tools[{index}].function.parameters must be a JSON schema object", param="tools")
    return {"type": "function", "function": dict(function)}


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request: what the proxy uses of it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None


def parse_chat_request(body: Any) -> ChatRequest:
    """Validates a chat-completions body. `model`, `temperature` and `top_p` are ignored: the run's policy
    samples at the run's temperature (the behaviour policy the loss needs); what would change the answer's
    meaning (n > 1, forced tool choice, a response format) is refused."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    normalized = [normalize_message(m, i) for i, m in enumerate(messages)]
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError("n must be 1: one episode samples one answer per call", param="n")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError("tool_choice must be auto: the policy decides whether to call a tool", param="tool_choice")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format is not supported", param="response_format")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError("max_tokens must be a positive integer", param="max_tokens")
    return ChatRequest(normalized, [_tool(t, i) for i, t in enumerate(tools)], stream,
                       bool(options.get("include_usage", False)), limit)


def canonical(message: Mapping[str, Any]) -> str:
    """A message's comparable form: role, content (null and "" alike), tool calls (arguments as parsed JSON
    where they parse), tool_call_id. Two messages that render alike compare equal."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        try:
            arguments: Any = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = function.get("arguments")
        calls.append([call.get("id", ""), function.get("name"), arguments])
    return json.dumps([message.get("role"), message.get("content") or "", calls, message.get("tool_call_id", "")],
                      sort_keys=True, ensure_ascii=False)


# --- opening an episode -------------------------------------------------------------------------


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int) -> int:
    value = body.get(name, default)
    if value is None:
        raise RequestError(f"{name} is required", param=name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}", param=name)
    return value


def episode_request(body: Any, run: str, families: Sequence[str]) -> dict[str, Any]:
    """The `task_requested`-shaped request (schemas/avro/task_requested.avsc) an episode rolls out, from the
    body of POST /episodes: {task, split, sample_index, member (0), group_size (1), epoch (0), validation (false)}.
    Members of one group share (task, split, sample_index, epoch), so their group id is the dispatcher's."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    task = body.get("task")
    if not isinstance(task, str) or task not in families:
        raise RequestError(f"task must be one of {', '.join(families)}, got {str(task)[:40]!r}", param="task")
    split = body.get("split")
    if not isinstance(split, str) or not split or len(split) > _MAX_ID_CHARS:
        raise RequestError("split must be a non-empty string", param="split")
    index, epoch = _int(body, "sample_index", None, 0), _int(body, "epoch", 0, 0)
    group_size = _int(body, "group_size", 1, 1)
    member = _int(body, "member", 0, 0)
    if member >= group_size:
        raise RequestError(f"member {member} is not below group_size {group_size}", param="member")
    validation = body.get("validation", False)
    if not isinstance(validation, bool):
        raise RequestError("validation must be true or false", param="validation")
    return {"run": run, "group_id": group_id(run, task, split, index, epoch), "member": member,
            "group_size": group_size, "task": task, "split": split, "sample_index": index, "epoch": epoch,
            "validation": validation, "policy_version": 0, "dispatched_at_ms": 0}


@dataclass(frozen=True)
class EpisodeEnd:
    """The body of POST /episodes/{id}/end: the environment's verdict."""

    reward: float
    status: Status
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def parse_end(body: Any) -> EpisodeEnd:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    reward = body.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise RequestError("reward must be a finite number", param="reward")
    allowed = [str(s) for s in CALLER_STATUSES]
    status = body.get("status", str(Status.COMPLETED))
    if status not in allowed:
        raise RequestError(f"status must be one of {', '.join(allowed)}, got {str(status)[:40]!r}", param="status")
    score = body.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)):
        raise RequestError("score must be a finite number or null", param="score")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in metrics.items()):
        raise RequestError("metrics must map names to finite numbers", param="metrics")
    return EpisodeEnd(float(reward), Status(status), None if score is None else float(score),
                      {k: float(v) for k, v in metrics.items()})


# --- responses ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """One answered call: the assistant message in OpenAI shape, why it stopped, and its token counts."""

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    recorded: bool


def answer_message(parsed: ParsedMessage, raw: str) -> dict[str, Any]:
    """The OpenAI assistant message of a sampled turn: its text outside the call blocks and its calls, or,
    when the calls do not parse, the raw text (the agent sees what the policy wrote)."""
    if parsed.error is not None or not parsed.tool_calls:
        return {"role": "assistant", "content": raw if parsed.error is not None else parsed.content}
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": parsed.tool_calls}


def finish_reason(engine_reason: str, message: Mapping[str, Any]) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def completion_response(completion: Completion, model: str, created: int, response_id: str) -> dict[str, Any]:
    """The `chat.completion` object."""
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": completion.message, "finish_reason": completion.finish_reason,
                     "logprobs": None}],
        "usage": {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                  "total_tokens": completion.prompt_tokens + completion.completion_tokens},
    }


def stream_chunks(completion: Completion, model: str, created: int, response_id: str,
                  include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed answer: the role, the text, each tool call whole,
    the finish reason, and the usage when asked. The turn is sampled whole first (its tokens are recorded
    before the agent sees any), so the stream has the shape, not the latency, of token streaming."""
    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}

    message = completion.message
    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, completion.finish_reason))
    if include_usage:
        usage = completion_response(completion, model, created, response_id)["usage"]
        chunks.append({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage})
    return chunks


def sse(chunks: Sequence[Mapping[str, Any]]) -> bytes:
    """Server-sent events of `chunks`, closed by OpenAI's `data: [DONE]`."""
    return "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


# --- one episode --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pending:
    """The last recorded turn, whose step waits for what follows it (the next call or the end)."""

    sampled: Sampled
    parsed: ParsedMessage


class Episode:
    """One episode's recording: the agent loop's `Loop`, driven by an outside agent's calls."""

    def __init__(self, request: Mapping[str, Any], encoder: ChatEncoder, pick_engine: PickEngine,
                 settings: ProxySettings, loop_settings: AgentLoopSettings, *, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]], on_step: Callable[[dict[str, Any]], None]) -> None:
        self.settings, self.loop_settings, self.clock = settings, loop_settings, clock
        self.loop = Loop({"request": dict(request), "turn_pools": []}, encoder, pick_engine, loop_settings, clock,
                         sleep, on_step)
        self.loop.loop_metrics.update({"reencode_mismatches": 0.0, "unrecorded_calls": 0.0})
        self.id = self.loop.id
        self.started = clock()
        self.last_active = self.started
        """When the caller last opened the episode or asked a call (`Episodes.expire_idle` reads it)."""
        self.recording = True
        """False after a re-encoding mismatch: calls are served from the agent's own history, unrecorded."""
        self.dropped = False
        self.ending: Ending | None = None
        """Set when the proxy itself ends the record (a limit, invalid output, an engine failure)."""
        self.pending: _Pending | None = None
        self.served: dict[str, dict[str, Any]] = {}
        """canonical(answer as served) -> the raw-text assistant message recorded for it."""
        self.finished = False

    @property
    def calls(self) -> int:
        return len(self.loop.turns) + (self.pending is not None)

    def as_history(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The request's messages with every answer the proxy served replaced by its raw sampled text."""
        return [dict(self.served.get(canonical(m), m)) if m["role"] == "assistant" else dict(m) for m in messages]

    async def complete(self, chat: ChatRequest) -> Completion:
        """Answers one call (recording it unless the record has ended); RequestError for a bad or late call,
        EngineUnavailable when no engine answers."""
        if self.finished:
            raise RequestError(f"episode {self.id} has ended", code="episode_ended")
        self.last_active = self.clock()
        if self.ending is not None and self.recording:
            raise RequestError(f"episode {self.id} can take no more calls: {self.ending.termination} "
                               f"({self.ending.status})", code="episode_ended")
        history = self.as_history(chat.messages)
        if self.recording and self.loop.prompt_tokens == 0:
            self.start(history, chat.tools)
        elif self.recording:
            new = self.continuation(history, chat.tools)
            if new is None:
                self.mismatch()
            else:
                self.append_context(new)
        if self.recording:
            return await self.recorded_turn(chat)
        return await self.unrecorded_turn(history, chat)

    # --- the record -----------------------------------------------------------------------------

    def start(self, history: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        loop = self.loop
        prompt = loop.encoder.encode(history, tools, add_generation_prompt=True)
        if len(prompt) + len(loop.encoder.assistant_close) >= self.loop_settings.max_total_len:
            raise RequestError(f"the prompt is {len(prompt)} tokens: no room for an answer within "
                               f"max_total_len {self.loop_settings.max_total_len}", code="context_length_exceeded")
        loop.history, loop.tools = history, list(tools)
        loop.record.add_context(prompt)
        loop.text_ids = list(prompt)
        loop.prompt_tokens = len(prompt)

    def continuation(self, history: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The messages the request adds after the recorded history, None when it does not continue it."""
        recorded = self.loop.history
        if len(history) <= len(recorded) or tools != self.loop.tools:
            return None
        if [canonical(m) for m in history[:len(recorded)]] != [canonical(m) for m in recorded]:
            return None
        return history[len(recorded):]

    def mismatch(self) -> None:
        """The request does not continue the record: counted, then `reencode_mismatch` decides."""
        self.loop.loop_metrics["reencode_mismatches"] += 1
        self.close_pending(env_tokens=0)
        self.recording = False
        self.dropped = self.settings.reencode_mismatch == "drop"

    def append_context(self, new: list[dict[str, Any]]) -> None:
        """Appends what the environment said (the difference of two encodings, loss_mask 0), as the agent loop
        does after an observation; the previous turn's step goes out with it."""
        loop = self.loop
        if self.calls >= self.loop_settings.max_turns:
            self.close_pending(env_tokens=0)
            self.ending = Ending(Status.TASK_LIMIT_REACHED, MAX_TURNS)
            raise RequestError(f"episode {self.id} reached max_turns {self.loop_settings.max_turns}",
                               code="turn_limit_reached")
        try:
            delta = loop.encoder.extension(loop.text_ids, [*loop.history, *new], loop.tools, True)
        except TemplatePrefixError:  # the agent's messages render the recorded part otherwise
            self.mismatch()
            return
        if len(loop.record.ids) + len(delta) + len(loop.encoder.assistant_close) >= self.loop_settings.max_total_len:
            self.close_pending(env_tokens=0)
            self.ending = Ending(Status.AGENT_CONTEXT_LIMIT, MAX_TOTAL_LEN)
            raise RequestError(f"episode {self.id} would exceed max_total_len {self.loop_settings.max_total_len} "
                               f"tokens", code="context_length_exceeded")
        loop.record.add_context(delta)
        loop.text_ids += delta
        loop.history.extend(new)
        self.close_pending(env_tokens=len(delta))

    def close_pending(self, env_tokens: int, status: Status = Status.RUNNING, reward: float = 0.0,
                      finish: bool = False) -> None:
        """Sends the waiting turn's step event and records its `turns` entry."""
        if self.pending is not None:
            self.loop.add_turn(TurnRecord(self.pending.sampled, status, finish, parsed=self.pending.parsed,
                                          reward=reward, env_tokens=env_tokens))
            self.pending = None

    async def recorded_turn(self, chat: ChatRequest) -> Completion:
        loop, turn = self.loop, self.calls
        room = self.loop_settings.max_total_len - len(loop.record.ids) - len(loop.encoder.assistant_close)
        sampled = await loop.sample_turn(turn, min(room, chat.max_tokens or room))
        if isinstance(sampled, str):
            self.ending = Ending(Status.TASK_ERROR, ENGINE_ERROR, error=sampled)
            raise EngineUnavailable(sampled)
        raw = loop.history[-1]["content"]
        parsed = parse_tool_calls(raw, call_id_prefix=f"call_{turn}")
        try:
            canonical_turn = loop.close_turn(sampled.generation.token_ids)
        except TemplatePrefixError as error:  # the chat template cannot be used: a configuration error
            self.ending = Ending(Status.TASK_ERROR, ENGINE_ERROR, error=str(error))
            raise
        if parsed.error is not None:
            loop.loop_metrics["parse_errors"] += 1
        message = answer_message(parsed, raw)
        if not canonical_turn:
            loop.loop_metrics["noncanonical_turns"] += 1
            loop.count_valid_calls(parsed)
            if self.loop_settings.noncanonical_turns == "end":  # as the agent loop: the turn is no message
                loop.add_turn(TurnRecord(sampled, Status.AGENT_VALIDATION_FAILED, finish=True))
                self.ending = Ending(Status.AGENT_VALIDATION_FAILED, INVALID_OUTPUT)
        if self.ending is None:
            self.pending = _Pending(sampled, parsed)
        self.served[canonical(message)] = loop.history[-1]
        generation = sampled.generation
        return Completion(message, finish_reason(generation.finish_reason, message), sampled.start,
                          len(generation.token_ids), recorded=True)

    async def unrecorded_turn(self, history: list[dict[str, Any]], chat: ChatRequest) -> Completion:
        """A call after the record ended at a mismatch: served from the agent's own history, not recorded."""
        loop = self.loop
        prompt = loop.encoder.encode(history, chat.tools, add_generation_prompt=True)
        room = self.loop_settings.max_total_len - len(prompt)
        if room < 1:
            raise RequestError(f"the prompt is {len(prompt)} tokens: over max_total_len "
                               f"{self.loop_settings.max_total_len}", code="context_length_exceeded")
        result = await loop.generate(CURRENT_POOL, min(room, chat.max_tokens or room, self.loop_settings.max_new_tokens),
                                     prompt_ids=prompt)
        if isinstance(result, str):
            raise EngineUnavailable(result)
        generation = result[1]
        loop.loop_metrics["unrecorded_calls"] += 1
        ids = generation.token_ids
        raw = loop.content_text(ids)
        message = answer_message(parse_tool_calls(raw, call_id_prefix=f"call_u{int(loop.loop_metrics['unrecorded_calls'])}"), raw)
        self.served[canonical(message)] = {"role": "assistant", "content": raw}
        return Completion(message, finish_reason(generation.finish_reason, message), len(prompt), len(ids),
                          recorded=False)

    # --- the end --------------------------------------------------------------------------------

    def finish(self, end: EpisodeEnd) -> dict[str, Any]:
        """Closes the episode with the caller's verdict; its trajectory event (steps were sent as they closed)."""
        if self.finished:
            raise RequestError(f"episode {self.id} has ended", code="episode_ended")
        self.finished = True
        self.close_pending(env_tokens=0, status=end.status, reward=end.reward, finish=True)
        loop = self.loop
        metrics = {**end.metrics, "caller_reward": end.reward}
        if self.dropped:
            ending = Ending(Status.TASK_ERROR, REENCODE_MISMATCH)
        elif self.ending is not None:
            ending = Ending(self.ending.status, self.ending.termination,
                            env_reward=0.0 if self.ending.status == Status.TASK_ERROR else end.reward)
        elif not loop.turns:
            ending = Ending(Status.TASK_ERROR, NO_CALLS)
        else:
            ending = Ending(end.status, ENV_FINISHED, env_reward=0.0 if end.status == Status.TASK_ERROR else end.reward)
        loop.env_metrics = metrics
        trajectory = loop.trajectory(ending, self.settings.worker_id, self.started, self.clock())
        if end.score is not None:
            trajectory["score"] = end.score
        return trajectory

    def expire(self) -> dict[str, Any]:
        """Closes an episode its caller left idle: its trajectory as task_error (masked out of its group)."""
        self.finished = True
        self.close_pending(env_tokens=0)
        return self.loop.trajectory(Ending(Status.TASK_ERROR, IDLE_TIMEOUT), self.settings.worker_id, self.started,
                                    self.clock())


class Episodes:
    """The proxy's open episodes by id, and what opening and ending one does."""

    def __init__(self, *, run: str, families: Sequence[str], make_episode: Callable[[dict[str, Any]], Episode],
                 settings: ProxySettings, on_trajectory: Callable[[dict[str, Any]], None]) -> None:
        self.run, self.families, self.make_episode, self.settings = run, list(families), make_episode, settings
        self.on_trajectory = on_trajectory
        self.open: dict[str, Episode] = {}
        self.counts = {"opened": 0, "published": 0, "dropped": 0, "cancelled": 0, "expired": 0}

    def open_episode(self, body: Any) -> dict[str, Any]:
        request = episode_request(body, self.run, self.families)
        episode_id = trajectory_id(self.run, request["group_id"], request["member"])
        if episode_id in self.open:
            raise RequestError(f"episode {episode_id} (group {request['group_id']}, member {request['member']}) "
                               f"is already open", code="episode_open")
        if len(self.open) >= self.settings.max_episodes:
            raise RequestError(f"{len(self.open)} episodes are open, the most the proxy holds "
                               f"(proxy.max_episodes); end one first", code="too_many_episodes")
        self.open[episode_id] = self.make_episode(request)
        self.counts["opened"] += 1
        return {"episode_id": episode_id, "trajectory_id": episode_id, "group_id": request["group_id"],
                "member": request["member"], "base_path": f"/episodes/{episode_id}/v1"}

    def get(self, episode_id: str) -> Episode:
        episode = self.open.get(episode_id)
        if episode is None:
            raise RequestError(f"no open episode {episode_id[:_MAX_ID_CHARS]!r}: open one with POST /episodes",
                               code="episode_not_found", status=404)
        return episode

    def end(self, episode_id: str, body: Any) -> dict[str, Any]:
        end = parse_end(body)
        episode = self.get(episode_id)
        trajectory = episode.finish(end)
        del self.open[episode_id]
        self.on_trajectory(trajectory)
        self.counts["published"] += 1
        self.counts["dropped"] += episode.dropped
        return {"episode_id": episode_id, "status": trajectory["status"], "reward": trajectory["reward"],
                "num_tokens": trajectory["num_tokens"], "turns": len(trajectory["turns"]),
                "trained": trajectory["status"] != str(Status.TASK_ERROR),
                "reencode_mismatches": trajectory["metrics"]["reencode_mismatches"]}

    def expire_idle(self, now: float, busy: Callable[[str], bool] = lambda episode_id: False) -> list[str]:
        """Ends every episode idle longer than settings.idle_timeout_s whose call is not in flight (`busy`),
        publishing each as task_error; the ids ended."""
        idle = [episode_id for episode_id, episode in self.open.items()
                if now - episode.last_active > self.settings.idle_timeout_s and not busy(episode_id)]
        for episode_id in idle:
            self.on_trajectory(self.open.pop(episode_id).expire())
            self.counts["published"] += 1
            self.counts["expired"] += 1
        return idle

    def cancel(self, episode_id: str) -> dict[str, Any]:
        """Forgets an episode without a trajectory (status cancelled: its group waits for a re-rollout or times out)."""
        self.get(episode_id)
        del self.open[episode_id]
        self.counts["cancelled"] += 1
        return {"episode_id": episode_id, "status": str(Status.CANCELLED)}


def response_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
