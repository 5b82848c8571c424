"""The environment API's contract, on a tiny echo family defined here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from env_workers.envs import registry
from env_workers.envs.base import (
    NO_TOOL_CALL,
    ActionError,
    EnvSettings,
    Environment,
    Opened,
    Outcome,
    Session,
    Status,
    TaskError,
    ToolCall,
    assistant_call,
    parse_call,
    tool,
)

TOOLS = [
    tool("echo", "Echo the text.", {"text": {"type": "string"}}),
    tool("finish", "End with a reward.", {"reward": {"type": "number"}}),
    tool("reject", "Always rejected by the task.", {"why": {"type": "string"}}),
    tool("crash", "Breaks the environment.", {}),
    tool("tags", "Takes a list of strings.", {"tags": {"type": "array", "items": {"type": "string"}}}),
]


class EchoEnvironment(Environment):
    family = "echo"

    def __init__(self, max_rounds: int = 3, fail_open: bool = False, fail_close: bool = False) -> None:
        super().__init__(max_rounds)
        self.fail_open, self.fail_close = fail_open, fail_close
        self.closed = 0

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        if self.fail_open:
            raise OSError("no sandbox")
        return Opened([{"role": "system", "content": "sys"}, {"role": "user", "content": sample["q"]}], TOOLS)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        if call.name == "finish":
            return Outcome("bye", Status.COMPLETED, call.arguments["reward"])
        if call.name == "reject":
            raise ActionError(call.arguments["why"])
        if call.name == "crash":
            raise RuntimeError("disk on fire")
        return Outcome(str(call.arguments.get("text", call.arguments.get("tags"))))

    async def close(self, session: Session) -> None:
        self.closed += 1
        if self.fail_close:
            raise OSError("cannot remove")


def _raw(name: str, arguments: str, call_id: str = "c1") -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _started(env: EchoEnvironment) -> Session:
    return await env.start({"id": "t0", "q": "say hi"})


def test_start_gives_chat_messages_and_openai_tool_schemas() -> None:
    session = _run(_started(EchoEnvironment()))
    assert [m["role"] for m in session.messages] == ["system", "user"]
    assert session.tools[0] == {
        "type": "function",
        "function": {"name": "echo", "description": "Echo the text.",
                     "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
    }


def test_tool_result_comes_back_as_tool_message_with_call_id() -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        return await env.observation(session, _raw("echo", json.dumps({"text": "hi"}), "abc"))

    obs = _run(go())
    assert obs.messages == [{"role": "tool", "tool_call_id": "abc", "content": "hi"}]
    assert (obs.reward, obs.status, obs.finish) == (0.0, Status.RUNNING, False)
    assert obs.metrics["tool_calls"] == 1 and obs.metrics["malformed_calls"] == 0


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("nope", "{}", "unknown tool 'nope'"),
        ("echo", "{not json", "not valid JSON"),
        ("echo", "[1, 2]", "must be a JSON object"),
        ("echo", "{}", "missing the required argument 'text'"),
        ("echo", '{"text": 3}', "must be of type string"),
        ("echo", '{"text": "a", "extra": 1}', "has no argument 'extra'"),
        ("tags", '{"tags": ["a", 2]}', "must be an array of string"),
        ("finish", '{"reward": true}', "must be of type number"),
    ],
)
def test_malformed_call_is_an_error_message_counted_not_an_exception(name: str, arguments: str, error: str) -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        return await env.observation(session, _raw(name, arguments))

    obs = _run(go())
    assert obs.status == Status.RUNNING and not obs.finish
    assert obs.messages[0]["role"] == "tool" and obs.messages[0]["tool_call_id"] == "c1"
    assert error in obs.messages[0]["content"]
    assert obs.metrics["malformed_calls"] == 1


def test_message_without_tool_calls_asks_for_one_and_counts_as_malformed() -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        return await env.observation(session, {"role": "assistant", "content": "just talking"})

    obs = _run(go())
    assert obs.messages == [{"role": "user", "content": NO_TOOL_CALL}]
    assert obs.metrics["malformed_calls"] == 1 and not obs.finish


def test_rejected_action_is_shown_and_counted_as_tool_error() -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        return await env.observation(session, _raw("reject", json.dumps({"why": "no such variable"})))

    obs = _run(go())
    assert obs.messages[0]["content"] == "Error: no such variable"
    assert obs.metrics["tool_errors"] == 1 and obs.status == Status.RUNNING


def test_finishing_call_ends_with_its_reward_and_stops_later_calls() -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        message = _raw("finish", json.dumps({"reward": 1.0}))
        message["tool_calls"].append(_raw("echo", json.dumps({"text": "late"}), "c2")["tool_calls"][0])
        return session, await env.observation(session, message)

    session, obs = _run(go())
    assert (obs.reward, obs.status, obs.finish) == (1.0, Status.COMPLETED, True)
    assert [m["tool_call_id"] for m in obs.messages] == ["c1"]
    assert session.finished


def test_round_limit_ends_with_task_limit_reached() -> None:
    async def go() -> list[Any]:
        env = EchoEnvironment(max_rounds=3)
        session = await _started(env)
        return [await env.observation(session, assistant_call("echo", {"text": "x"})) for _ in range(3)]

    observations = _run(go())
    assert [o.finish for o in observations] == [False, False, True]
    assert observations[-1].status == Status.TASK_LIMIT_REACHED and observations[-1].reward == 0.0
    assert observations[-1].metrics["rounds"] == 3


def test_environment_exception_ends_session_as_task_error() -> None:
    async def go() -> Any:
        env = EchoEnvironment()
        session = await _started(env)
        obs = await env.observation(session, _raw("crash", "{}"))
        await env.end(session)
        return env, obs

    env, obs = _run(go())
    assert (obs.status, obs.finish, obs.reward) == (Status.TASK_ERROR, True, 0.0)
    assert obs.metrics["task_errors"] == 1 and env.closed == 1


def test_observation_after_the_end_is_refused() -> None:
    async def go() -> None:
        env = EchoEnvironment()
        session = await _started(env)
        await env.observation(session, assistant_call("finish", {"reward": 0.0}))
        await env.observation(session, assistant_call("echo", {"text": "again"}))

    with pytest.raises(ValueError, match="is over"):
        _run(go())


def test_end_is_idempotent_and_releases_once() -> None:
    async def go() -> tuple[EchoEnvironment, Session]:
        env = EchoEnvironment()
        session = await _started(env)
        await env.end(session)
        await env.end(session)
        return env, session

    env, session = _run(go())
    assert env.closed == 1 and session.ended and session.status == Status.CANCELLED


def test_end_swallows_a_failing_release() -> None:
    async def go() -> EchoEnvironment:
        env = EchoEnvironment(fail_close=True)
        session = await _started(env)
        await env.end(session)
        await env.end(session)
        return env

    assert _run(go()).closed == 1


def test_start_failure_raises_task_error_after_releasing() -> None:
    env = EchoEnvironment(fail_open=True)
    with pytest.raises(TaskError, match="no sandbox"):
        _run(_started(env))
    assert env.closed == 1


def test_parse_call_accepts_arguments_already_decoded() -> None:
    call = parse_call({"id": "x", "function": {"name": "echo", "arguments": {"text": "hi"}}}, TOOLS)
    assert call == ToolCall(id="x", name="echo", arguments={"text": "hi"})


def test_status_values_are_the_avro_enum_symbols() -> None:
    schema = json.loads(open("schemas/avro/status.avsc").read())
    assert [s.value for s in Status] == schema["symbols"]


def test_registry_addresses_samples_by_family_split_and_index() -> None:
    settings = EnvSettings()
    assert registry.sample("db", "dev", 3, settings)["id"] == "dev-3"
    assert registry.sample("calc", "dev", 0, settings) == registry.sample("calc", "dev", 0, settings)
    assert len(registry.samples("db", "standard", settings)) == 200
    with pytest.raises(IndexError):
        registry.sample("db", "dev", 60, settings)


def test_registry_rejects_unknown_family_and_split() -> None:
    with pytest.raises(registry.UnknownFamily, match="unknown family 'chess'"):
        registry.family("chess")
    with pytest.raises(registry.UnknownFamily, match="has no split 'holdout'"):
        registry.samples("db", "holdout", EnvSettings())


def test_settings_are_frozen_and_reject_unknown_fields() -> None:
    settings = EnvSettings()
    with pytest.raises(ValueError):
        EnvSettings(rounds=3)
    with pytest.raises(ValueError):
        settings.db_rounds = 3  # type: ignore[misc]
    assert (settings.db_rounds, settings.kg_rounds, settings.os_rounds) == (15, 15, 8)


def test_metrics_of_the_set_up_start_the_sessions_running_totals() -> None:
    class CountingSetUp(EchoEnvironment):
        async def open(self, sample: Mapping[str, Any]) -> Opened:
            return Opened([{"role": "user", "content": sample["q"]}], TOOLS, metrics={"init_failures": 1.0})

    async def run() -> dict[str, float]:
        env = CountingSetUp()
        session = await _started(env)
        observation = await env.observation(session, _raw("echo", '{"text": "x"}'))
        return observation.metrics

    metrics = _run(run())
    assert metrics["init_failures"] == 1.0 and metrics["rounds"] == 1.0
