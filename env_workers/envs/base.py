"""The one environment API every task family implements (ARCHITECTURE.md "Unified function-call environments").

Lifecycle, all async:

    session = await env.start(sample)            # session.messages (system, user), session.tools
    obs = await env.observation(session, msg)    # msg: OpenAI assistant message dict
    await env.end(session)                       # idempotent, safe after a crash

`msg` carries `tool_calls` ([{id, type: "function", function: {name, arguments: JSON text}}]) or a
plain `content`. Tool results come back as role "tool" messages with the call's `tool_call_id`;
feedback on a message without tool calls comes back as a role "user" message.

Who is to blame decides the outcome (AgentRL masks infrastructure failures out of training):
- a malformed call (unknown tool, arguments that are not a JSON object, a missing or mistyped
  argument, no tool call at all) is the policy's mistake: an error message it sees, counted in
  `metrics["malformed_calls"]` (and, when it was a call, in `metrics["refused_calls"]`), and the
  session goes on;
- a well-formed call the task rejects (a variable that does not exist, SQL that fails) raises
  `ActionError` inside the family: an error message, counted in `metrics["tool_errors"]`;
- any other exception inside the environment is an infrastructure failure: the session ends with
  status `task_error`, reward 0;
- the family's round limit ends the session with `task_limit_reached`.

A family subclasses `Environment` and writes four hooks: `open` (build the task's state, prompt
and tools), `call_tool` (one well-formed call -> `Outcome`), optionally `on_text` (an assistant
message without tool calls) and `close` (release what `open` acquired). It publishes a `Family`
record (loader, environment factory, oracle and no-op policies) that the registry finds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from env_workers.sandbox.settings import SandboxSettings
from schemas.status import Status

log = logging.getLogger(__name__)

# <repo root>/../shared/data; pipeline/ overrides it from ROLLSTREAM_DATA (only pipeline/ reads the environment).
DEFAULT_DATA_ROOT = Path(__file__).resolve().parents[2].parent / "shared" / "data"


class CalcSplitOperations(BaseModel):
    """Operation-count ranges of the calc splits that differ from `EnvSettings.calc_operations` (None: the same)."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # frozen: EnvSettings is hashed to cache samples

    train: tuple[int, int] | None = None
    rl: tuple[int, int] | None = None
    dev: tuple[int, int] | None = None

    @field_validator("train", "rl", "dev")
    @classmethod
    def _a_positive_range(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"expected 1 <= smallest <= largest, got {list(bounds)}")
        return bounds

    def get(self, split: str, default: tuple[int, int]) -> tuple[int, int]:
        bounds: tuple[int, int] | None = getattr(self, split, None)
        return default if bounds is None else bounds


class EnvSettings(BaseModel):
    """Where the task data lives, each family's round limit, the db family's server and the os family's sandboxes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_root: Path = DEFAULT_DATA_ROOT
    """Root of the shipped task data (`../shared/data`; pipeline/ reads ROLLSTREAM_DATA)."""
    os_rounds: int = 8
    """AgentBench OS interaction: 8 rounds."""
    db_rounds: int = 15
    """AgentBench DBBench: 15 rounds."""
    db_query_timeout_s: float = 60.0
    """AgentBench DBBench: a statement is cut off after 60 s."""
    db_backend: Literal["sqlite", "mysql"] = "sqlite"
    """Where each db session's database lives: in-memory SQLite, or a MySQL-compatible server (AgentBench: MySQL)."""
    db_mysql_host: str = "127.0.0.1"
    """MySQL/MariaDB server host (infra/mariadb.sh serves on MARIADB_HOST, 127.0.0.1)."""
    db_mysql_port: int = 3307
    """MySQL/MariaDB server port (infra/mariadb.sh's MARIADB_PORT; 3307 keeps clear of a system server's 3306)."""
    db_mysql_socket: Path | None = None
    """Unix socket of the server; when set, it is used instead of host and port."""
    db_mysql_user: str = "rollstream"
    """Account that creates and drops each session's database and user (needs CREATE USER and GRANT OPTION)."""
    db_mysql_password: SecretStr = SecretStr("rollstream-local-secret")
    """Password of that account (infra/mariadb.sh's MARIADB_PASSWORD)."""
    db_mysql_user_connections: int = Field(2, ge=1)
    """Connections one session's user may hold at once (no paper default: one, plus one for a reconnect)."""
    db_tier_seed: int = 7
    """Seed of the generated db tiers (db_tiers.py: easy-*, two-table-*; the data README's Random(7) convention)."""
    db_tier_train_tasks: int = Field(800, ge=1)
    """Generated tasks in each db tier's train split (no paper default: many hundreds, the issue asks)."""
    db_tier_dev_tasks: int = Field(100, ge=1)
    """Generated tasks in each db tier's held-out dev split (none shares its prompt and tables with train)."""
    kg_rounds: int = 15
    """AgentBench KG: 15 rounds."""
    calc_rounds: int = 8
    """AgentRL's simple calculator example: a few turns (8 leaves room for three operations and a retry)."""
    calc_seed: int = 7
    """Seed of the generated calculator tasks (the data README's Random(7) convention)."""
    calc_train_tasks: int = 5000
    """Generated calculator tasks in the train split (no paper default; small and fast for CPU checks)."""
    calc_rl_tasks: int = 2000
    """Generated calculator tasks in the rl split: drawn like train's (unless calc_split_operations says
    otherwise), but no SFT demonstration comes from it. A small policy memorizes the tasks it was fine-tuned on
    and then solves each in all n samples or in none, which gives GRPO groups of equal rewards and nothing to
    learn from; RL after SFT trains on this split."""
    calc_dev_tasks: int = 200
    """Generated calculator tasks in the dev split."""
    calc_operands: tuple[int, int] = (2, 30)
    """Smallest and largest operand of a generated calculator task (AgentRL's example leaves it open)."""
    calc_operations: tuple[int, int] = (1, 3)
    """Fewest and most operations of a generated calculator task (a few turns, as AgentRL's example)."""
    calc_split_operations: CalcSplitOperations = CalcSplitOperations()
    """Splits whose operation counts differ from calc_operations, e.g. {rl: [3, 3], dev: [3, 3]}: RL and its
    validation on longer expressions than the demonstrations, where a fine-tuned policy still fails often enough
    for GRPO groups to differ."""
    os_tier_seed: int = 7
    """Seed of the generated os easy tier (os_tiers.py: easy-train, easy-dev)."""
    os_tier_train_tasks: int = Field(600, ge=1)
    """Generated shell tasks in the os easy-train split (no paper default)."""
    os_tier_dev_tasks: int = Field(60, ge=1)
    """Generated shell tasks in the os easy-dev split (none is word for word an easy-train task)."""
    os_sandbox: SandboxSettings = SandboxSettings()
    """The os family's sandbox backend and limits (AgentBench: Docker containers, 30 s per command); the python
    family runs its code in the same sandboxes, under the same limits and output cut (its own time limit below)."""
    python_rounds: int = Field(8, ge=1)
    """Round limit of the python family (no paper default: room for python_max_code_runs runs, retries, the answer)."""
    python_max_code_runs: int = Field(4, ge=1)
    """ToRL's C: code runs one trajectory may make; further run_python calls are refused, not run, and the policy
    must answer without them (ToRL: past C, code is no longer executed). No ToRL value is reproduced here."""
    python_timeout_s: float = Field(10.0, gt=0)
    """Wall time of one code run before its processes are killed (no paper default; ToRL leaves it to its sandbox)."""
    python_unexecuted_code_penalty: bool = False
    """ToRL's executability penalty, off by default: when on, an answer submitted in an episode none of whose code
    runs succeeded (exited 0 within the time limit; no run at all counts as none) gets -0.5 added to its reward, so
    a wrong answer gets -0.5 and a right one 0.5. ToRL adds it to responses holding any non-executable code."""
    python_seed: int = 7
    """Seed of the generated python word problems (python_tasks.py; the data README's Random(7) convention)."""
    python_train_tasks: int = Field(300, ge=1)
    """Generated word problems in the python train split (no paper default: a few hundred, the issue asks)."""
    python_dev_tasks: int = Field(50, ge=1)
    """Generated word problems in the python dev split (none is word for word a train problem)."""

    @field_validator("calc_operands", "calc_operations")
    @classmethod
    def _a_positive_range(cls, bounds: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"expected 1 <= smallest <= largest, got {list(bounds)}")
        return bounds


class ActionError(Exception):
    """A well-formed tool call that the task rejects; its message is shown to the policy."""


class TaskError(Exception):
    """The environment itself failed (infrastructure, not the policy): the session is `task_error`."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed, schema-checked function call."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What one tool call (or one plain-text answer) did: text for the policy, and whether it ended the task."""

    content: str
    status: Status = Status.RUNNING
    reward: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def finish(self) -> bool:
        return self.status != Status.RUNNING


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one assistant message. `metrics` are the session's running totals."""

    messages: list[dict[str, Any]]
    reward: float
    status: Status
    finish: bool
    metrics: dict[str, float]


@dataclass
class Session:
    """One episode of one task. `state` belongs to the family; the rest is bookkeeping of the base class."""

    id: str
    sample: Mapping[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    state: Any = None
    rounds: int = 0
    status: Status = Status.RUNNING
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    ended: bool = False

    @property
    def finished(self) -> bool:
        return self.status != Status.RUNNING


@dataclass(frozen=True)
class Opened:
    """What a family's `open` hook returns: the prompt, the tools, the family's private state and
    metrics of the set-up (they start the session's running totals)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    state: Any = None
    metrics: Mapping[str, float] = field(default_factory=dict)


def tool(name: str, description: str, parameters: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """An OpenAI function-call schema; every parameter is required (as in AgentBench's tool definitions)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": dict(parameters), "required": list(parameters)},
        },
    }


def assistant_call(name: str, arguments: Mapping[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """An assistant message with one tool call, as a policy (or an oracle) emits it."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        ],
    }


# A policy maps the conversation so far (prompt, assistant and environment messages) to the next
# assistant message. Oracles and no-op policies are policies, so they may react to tool output.
Policy = Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]


def scripted(messages: Sequence[dict[str, Any]]) -> Policy:
    """A policy that replays fixed assistant messages in order (and repeats the last one if asked for more)."""
    replies = list(messages)

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turn = sum(1 for m in history if m.get("role") == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return policy


@dataclass(frozen=True)
class Family:
    """A task family as the registry and `rollstream env check` see it.

    Samples are plain dicts with at least a string "id"; `load` reads one data file in the
    family's shipped format (wherever it lies) into samples; `splits` names the files of each
    split relative to the data root. A family whose tasks are generated, not read (calc), lists
    its splits with no files and gives `generate` (split, settings -> samples).
    """

    name: str
    make: Callable[[EnvSettings], "Environment"]
    load: Callable[[Path], list[dict[str, Any]]]
    splits: Mapping[str, tuple[str, ...]]
    golden: Callable[[Mapping[str, Any]], Policy]
    noop: Callable[[Mapping[str, Any]], Policy]
    generate: Callable[[str, EnvSettings], list[dict[str, Any]]] | None = None


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _type_error(name: str, schema: Mapping[str, Any], value: Any) -> str | None:
    expected = schema.get("type")
    python_type = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
    if python_type is None:
        return None
    # bool is an int in Python, not in JSON.
    if not isinstance(value, python_type) or (expected in ("integer", "number") and isinstance(value, bool)):
        return f"argument '{name}' must be of type {expected}"
    if expected == "array" and "items" in schema:
        for item in value:
            if _type_error(f"{name}[]", schema["items"], item):
                return f"argument '{name}' must be an array of {schema['items'].get('type')}"
    return None


def parse_call(raw: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]) -> ToolCall | str:
    """Checks one raw tool call against the tools' schemas: the call, or the error text for the policy."""
    function = raw.get("function") or {}
    name = function.get("name")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if name not in by_name:
        return f"Error: unknown tool '{name}'. Available tools: {', '.join(by_name)}."
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return f"Error: the arguments of '{name}' are not valid JSON ({error.msg})."
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"Error: the arguments of '{name}' must be a JSON object."
    parameters = by_name[name].get("parameters", {})
    properties = parameters.get("properties", {})
    for required in parameters.get("required", []):
        if required not in arguments:
            return f"Error: '{name}' is missing the required argument '{required}'."
    for key, value in arguments.items():
        if key not in properties:
            return f"Error: '{name}' has no argument '{key}'."
        problem = _type_error(key, properties[key], value)
        if problem:
            return f"Error: {problem} in '{name}'."
    return ToolCall(id=str(raw.get("id") or ""), name=name, arguments=arguments)


NO_TOOL_CALL = "Error: no tool call found. Respond by calling one of the provided tools."


class Environment(ABC):
    """Base of every family: the lifecycle, malformed-call handling, round limit and failure policy."""

    family: str = ""

    def __init__(self, max_rounds: int) -> None:
        self.max_rounds = max_rounds

    # --- the family's hooks -------------------------------------------------------------------

    @abstractmethod
    async def open(self, sample: Mapping[str, Any]) -> Opened:
        """Builds the task: prompt messages, tools and private state (a database, a sandbox, ...)."""

    @abstractmethod
    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        """Runs one well-formed call; raises ActionError for a call the task rejects."""

    async def on_text(self, session: Session, content: str) -> Outcome | None:
        """An assistant message without tool calls; None means "not an action" (counted as malformed)."""
        return None

    async def close(self, session: Session) -> None:
        """Releases what `open` acquired. Called once, also when `open` or a tool crashed."""

    # --- the lifecycle ------------------------------------------------------------------------

    async def start(self, sample: Mapping[str, Any]) -> Session:
        """Opens a session; raises TaskError (after releasing what was acquired) when the task cannot be built."""
        session = Session(id=uuid.uuid4().hex, sample=sample, messages=[], tools=[])
        # Shielded: cancelling `open` midway could lose what a worker thread is still creating (a
        # container), so a cancelled start lets it finish, releases what it built, then re-raises.
        opening = asyncio.ensure_future(self.open(sample))
        try:
            opened = await asyncio.shield(opening)
        except asyncio.CancelledError:
            await self._release_abandoned(opening, session)
            raise
        except Exception as error:
            await self.end(session)
            raise TaskError(f"{self.family}: cannot start task {sample.get('id')!r}: {error!r}") from error
        session.messages, session.tools, session.state = opened.messages, opened.tools, opened.state
        session.metrics = {"rounds": 0.0, "tool_calls": 0.0, "malformed_calls": 0.0, "refused_calls": 0.0,
                           "tool_errors": 0.0,
                           **opened.metrics}
        return session

    async def observation(self, session: Session, assistant_message: Mapping[str, Any]) -> Observation:
        """Applies one assistant message. Never raises for the policy's or the environment's failures."""
        if session.finished or session.ended:
            raise ValueError(f"session {session.id} is over ({session.status}); start a new one")
        session.rounds += 1
        session.metrics["rounds"] = float(session.rounds)
        try:
            messages, outcome = await self._apply(session, assistant_message)
        except Exception as error:  # the environment broke, not the policy: masked from training
            log.exception("%s: environment failure in session %s", self.family, session.id)
            session.metrics["task_errors"] = 1.0
            return self._finish(session, [], Outcome(f"task error: {error!r}", Status.TASK_ERROR))
        if outcome is None and session.rounds >= self.max_rounds:
            outcome = Outcome("", Status.TASK_LIMIT_REACHED)
        if outcome is None:
            return Observation(messages, 0.0, Status.RUNNING, False, dict(session.metrics))
        return self._finish(session, messages, outcome)

    async def end(self, session: Session) -> None:
        """Releases the session; idempotent, and safe after a crash (a failure to release is logged, not raised)."""
        if session.ended:
            return
        session.ended = True
        if session.status == Status.RUNNING:
            session.status = Status.CANCELLED
        try:
            await self.close(session)
        except Exception:
            log.exception("%s: releasing session %s failed", self.family, session.id)

    # --- internals ----------------------------------------------------------------------------

    async def _release_abandoned(self, opening: asyncio.Future[Opened], session: Session) -> None:
        """Waits out the `open` of a cancelled start, however often cancelled again (every family's
        open is bounded by its own timeouts), and ends the session it built."""
        while not opening.done():
            try:
                await asyncio.wait({opening})
            except asyncio.CancelledError:
                continue
        if not opening.cancelled() and opening.exception() is None:
            session.state = opening.result().state
        await asyncio.shield(self.end(session))

    async def _apply(
        self, session: Session, assistant_message: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], Outcome | None]:
        """Runs the message's calls in order, stopping at the first that ends the task."""
        raw_calls = assistant_message.get("tool_calls") or []
        if not raw_calls:
            outcome = await self.on_text(session, assistant_message.get("content") or "")
            if outcome is None:
                session.metrics["malformed_calls"] += 1
                return [{"role": "user", "content": NO_TOOL_CALL}], None
            return self._text_reply(outcome), outcome if outcome.finish else None
        messages: list[dict[str, Any]] = []
        for raw in raw_calls:
            session.metrics["tool_calls"] += 1
            call = parse_call(raw, session.tools)
            if isinstance(call, str):
                session.metrics["malformed_calls"] += 1
                session.metrics["refused_calls"] += 1
                messages.append(_tool_message(raw, call))
                continue
            try:
                outcome = await self.call_tool(session, call)
            except ActionError as error:
                session.metrics["tool_errors"] += 1
                messages.append(_tool_message(raw, f"Error: {error}"))
                continue
            messages.append(_tool_message(raw, outcome.content))
            if outcome.finish:
                return messages, outcome
        return messages, None

    @staticmethod
    def _text_reply(outcome: Outcome) -> list[dict[str, Any]]:
        return [{"role": "user", "content": outcome.content}] if outcome.content else []

    @staticmethod
    def _finish(session: Session, messages: list[dict[str, Any]], outcome: Outcome) -> Observation:
        session.status, session.reward = outcome.status, outcome.reward
        session.metrics.update(outcome.metrics)
        return Observation(messages, outcome.reward, outcome.status, True, dict(session.metrics))


def _tool_message(raw: Mapping[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": str(raw.get("id") or ""), "content": content}
