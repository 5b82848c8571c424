"""The recording proxy's HTTP layer (env_workers/proxy_server.py) in-process, with a scripted engine: the
official openai client (plain and streamed) drives an episode, and every bad request is an HTTP error with
OpenAI's error body and a one-line message, the server answering the next request as before."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import EngineError
from env_workers.proxy import Episode, Episodes
from env_workers.proxy_server import make_app
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from pipeline.analysis.replay_verify import token_problems
from pipeline.policy.model_init import build_tokenizer
from pipeline.run.config import REPO_ROOT

from test_agent_loop import CALL, TOOLS, ScriptedEngine

LOOP = AgentLoopSettings(engine_retry_backoff_s=0.0, engine_retries=1)
OPEN = {"task": "calc", "split": "train", "sample_index": 2, "member": 1, "group_size": 2}
MESSAGES = [{"role": "system", "content": "Add numbers."}, {"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(build_tokenizer())


def serve(encoder: ChatEncoder, replies: list[Any], settings: ProxySettings = ProxySettings(),
          clock: Callable[[], float] | None = None) -> tuple[TestClient, list[dict[str, Any]], list[dict[str, Any]]]:
    """A test server over a scripted engine; `clock` (default: a fixed time, the episodes' own ticking 0.01 s per
    reading) is the episodes' and the server's."""
    engine, ticks = ScriptedEngine(encoder, replies), itertools.count()
    steps: list[dict[str, Any]] = []
    published: list[dict[str, Any]] = []

    def make_episode(request: dict[str, Any]) -> Episode:
        return Episode(request, encoder, lambda pool: (pool, engine), settings, LOOP,
                       clock=clock or (lambda: 1_700_000_000 + next(ticks) * 0.01), sleep=lambda s: asyncio.sleep(0),
                       on_step=steps.append)

    episodes = Episodes(run="run-1", families=["calc", "db"], make_episode=make_episode, settings=settings,
                        on_trajectory=published.append)
    return TestClient(TestServer(make_app(episodes, model="rollstream", clock=clock or (lambda: 1_700_000_000)))), steps, published


def test_openai_client_drives_an_episode_plain_and_streamed(encoder):
    async def scenario() -> None:
        client, steps, published = serve(encoder, [f"Adding.\n{CALL}", CALL, "The answer is 3."])
        async with client:
            opened = await (await client.post("/episodes", json=OPEN)).json()
            agent = AsyncOpenAI(base_url=str(client.make_url(opened["base_path"])), api_key="-", max_retries=0)
            messages = list(MESSAGES)
            first = await agent.chat.completions.create(model="any", messages=messages, tools=TOOLS)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "add"
            messages += [message.model_dump(exclude_none=True),
                         *({"role": "tool", "tool_call_id": c.id, "content": "3"} for c in message.tool_calls)]
            stream = await agent.chat.completions.create(model="any", messages=messages, tools=TOOLS, stream=True)
            calls: dict[int, dict[str, str]] = {}
            async for chunk in stream:
                for delta_call in chunk.choices[0].delta.tool_calls or []:
                    calls.setdefault(delta_call.index, {"id": delta_call.id, "name": delta_call.function.name,
                                                        "arguments": delta_call.function.arguments})
            assert [c["name"] for c in calls.values()] == ["add"]
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]}, *({"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in calls.values())]
            last = await agent.chat.completions.create(model="any", messages=messages, tools=TOOLS)
            assert last.choices[0].message.content == "The answer is 3." and last.choices[0].finish_reason == "stop"
            ended = await (await client.post(f"/episodes/{opened['episode_id']}/end",
                                             json={"reward": 1.0, "status": "completed"})).json()
            assert ended["status"] == "completed" and ended["turns"] == 3 and ended["trained"]
            health = await (await client.get("/health")).json()
            assert health["open"] == 0 and health["published"] == 1
        [trajectory] = published
        assert trajectory["member"] == 1 and trajectory["group_size"] == 2 and len(steps) == 3
        assert trajectory["metrics"]["reencode_mismatches"] == 0.0
        assert token_problems(trajectory) == []

    asyncio.run(scenario())


BAD = [
    ("post", "/episodes", b"{not json", 400, "the request body is not JSON"),
    ("post", "/episodes", json.dumps({"task": "chess", "split": "x", "sample_index": 0}).encode(), 400, "task must be one of"),
    ("post", "/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode(), 404, "no episode in the path"),
    ("post", "/episodes/unknown/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode(), 404, "no open episode"),
    ("post", "/episodes/unknown/end", json.dumps({"reward": 1}).encode(), 404, "no open episode"),
    ("get", "/nowhere", b"", 404, "GET /nowhere: Not Found"),
]


def test_bad_requests_get_openai_error_bodies_and_the_server_goes_on(encoder):
    async def scenario() -> None:
        client, _, _ = serve(encoder, [CALL])
        async with client:
            for method, path, data, status, message in BAD:
                response = await client.request(method, path, data=data)
                body = await response.json()
                assert response.status == status, (path, body)
                assert message in body["error"]["message"] and "\n" not in body["error"]["message"]
                assert body["error"]["type"] == "invalid_request_error"
            opened = await (await client.post("/episodes", json=OPEN)).json()
            agent = AsyncOpenAI(base_url=str(client.make_url(opened["base_path"])), api_key="-", max_retries=0)
            with pytest.raises(BadRequestError, match="n must be 1"):
                await agent.chat.completions.create(model="any", messages=MESSAGES, n=2)
            with pytest.raises(NotFoundError, match="no open episode"):
                other = AsyncOpenAI(base_url=str(client.make_url("/episodes/x/v1")), api_key="-", max_retries=0)
                await other.chat.completions.create(model="any", messages=MESSAGES)
            reply = await agent.chat.completions.create(model="any", messages=MESSAGES, tools=TOOLS)
            assert reply.choices[0].message.tool_calls

    asyncio.run(scenario())


def test_engine_failure_is_a_503_and_the_episode_is_a_task_error(encoder):
    async def scenario() -> None:
        client, _, published = serve(encoder, [EngineError("engine gone")])
        async with client:
            opened = await (await client.post("/episodes", json=OPEN)).json()
            base = opened["base_path"]
            response = await client.post(f"{base}/chat/completions", json={"messages": MESSAGES})
            assert response.status == 503 and "engine gone" in (await response.json())["error"]["message"]
            late = await client.post(f"{base}/chat/completions", json={"messages": MESSAGES})
            assert late.status == 400 and "can take no more calls" in (await late.json())["error"]["message"]
            await client.post(f"/episodes/{opened['episode_id']}/end", json={"reward": 1.0})
        assert published[0]["status"] == "task_error" and published[0]["reward"] == 0.0

    asyncio.run(scenario())


def test_the_server_ends_an_episode_left_idle_and_answers_its_late_call_404(encoder):
    async def scenario() -> None:
        client, _, published = serve(encoder, [CALL], ProxySettings(idle_timeout_s=0.05), clock=time.time)
        async with client:
            opened = await (await client.post("/episodes", json=OPEN)).json()
            for _ in range(100):
                if published:
                    break
                await asyncio.sleep(0.02)
            late = await client.post(f"{opened['base_path']}/chat/completions", json={"messages": MESSAGES})
            assert late.status == 404 and "no open episode" in (await late.json())["error"]["message"]
            health = await (await client.get("/health")).json()
            assert (health["open"], health["expired"], health["published"]) == (0, 1, 1)
        [trajectory] = published
        assert (trajectory["status"], trajectory["termination"]) == ("task_error", "idle_timeout")

    asyncio.run(scenario())


def test_example_agent_drives_calc_and_db_episodes_through_the_proxy(encoder):
    """examples/openai_agent.py, the openai-client agent, against the in-process proxy (scripted engine)."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import openai_agent

    async def scenario() -> list[dict[str, Any]]:
        client, steps, published = serve(encoder, ["I will think about it.", CALL])
        async with client:
            results = []
            for task in ("calc", "db"):
                results += await openai_agent.main(openai_agent.parse([
                    "--proxy", str(client.make_url("/")), "--task", task, "--samples", "0", "--group-size", "2",
                    "--max-turns", "2"]))
        assert len(published) == 4 and len(steps) == sum(len(t["turns"]) for t in published)
        for trajectory in published:
            assert token_problems(trajectory) == [] and trajectory["metrics"]["reencode_mismatches"] == 0.0
            assert len(trajectory["turns"]) == 2 and trajectory["status"] != "task_error"
        return results

    results = asyncio.run(scenario())
    assert sorted((r["task"], r["member"]) for r in results) == [("calc", 0), ("calc", 1), ("db", 0), ("db", 1)]
