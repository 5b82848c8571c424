"""A cancelled `Environment.start` releases what its family's `open` acquired (pure asyncio)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from env_workers.envs.base import Environment, Opened, Outcome, Session, TaskError, ToolCall


class SlowOpenEnvironment(Environment):
    """`open` takes a while to build a resource (as a sandbox does) and only then returns it."""

    family = "slow"

    def __init__(self, open_s: float, fail: bool = False) -> None:
        super().__init__(max_rounds=3)
        self.open_s, self.fail = open_s, fail
        self.held: set[str] = set()
        self.closed_states: list[Any] = []

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        await asyncio.sleep(self.open_s)
        if self.fail:
            raise OSError("the sandbox did not come up")
        resource = f"sandbox-{sample['id']}"
        self.held.add(resource)
        return Opened([{"role": "user", "content": "hi"}], [], state=resource)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        return Outcome("ok")

    async def close(self, session: Session) -> None:
        self.closed_states.append(session.state)
        self.held.discard(session.state)


async def _cancel_start(env: SlowOpenEnvironment, cancels: int) -> None:
    start = asyncio.ensure_future(env.start({"id": "t0"}))
    for _ in range(cancels):
        await asyncio.sleep(0.01)
        start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start


def test_cancelled_start_waits_for_open_and_releases_what_it_built() -> None:
    env = SlowOpenEnvironment(open_s=0.1)
    asyncio.run(_cancel_start(env, cancels=1))
    assert env.held == set()
    assert env.closed_states == ["sandbox-t0"]


def test_start_cancelled_repeatedly_still_releases_once() -> None:
    env = SlowOpenEnvironment(open_s=0.1)
    asyncio.run(_cancel_start(env, cancels=3))
    assert env.held == set()
    assert env.closed_states == ["sandbox-t0"]


def test_cancelled_start_whose_open_fails_raises_cancellation_not_task_error() -> None:
    env = SlowOpenEnvironment(open_s=0.05, fail=True)
    asyncio.run(_cancel_start(env, cancels=1))
    assert env.closed_states == [None]


def test_start_that_is_not_cancelled_is_unchanged() -> None:
    async def run() -> tuple[Session, SlowOpenEnvironment]:
        env = SlowOpenEnvironment(open_s=0.01)
        return await env.start({"id": "t1"}), env

    session, env = asyncio.run(run())
    assert session.state == "sandbox-t1" and env.held == {"sandbox-t1"} and env.closed_states == []
    with pytest.raises(TaskError):
        asyncio.run(SlowOpenEnvironment(open_s=0.01, fail=True).start({"id": "t2"}))
