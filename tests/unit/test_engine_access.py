"""Who may reach an engine: engines bind to loopback unless told otherwise, and an API key set in
`agent_loop.engine_api_key` is required by the engine's vLLM server and sent by its callers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from pydantic import SecretStr

from env_workers.engine_client import EngineClient, auth_headers
from env_workers.settings import AgentLoopSettings
from pipeline.engine.supervisor import API_KEY_ENV, EngineJob, EngineSettings, server_environment
from pipeline.run.config import EngineFleetSettings, load_config, settings_json

KEY = SecretStr("s3cret-key")


def test_engines_serve_on_loopback_by_default():
    assert EngineFleetSettings().bind_host == "127.0.0.1"
    assert EngineJob(model=Path("m"), run="r", engine_id="e").host == "127.0.0.1"


def test_no_key_means_no_authorization_header():
    assert auth_headers(None) == {} and auth_headers(SecretStr("")) == {}


def test_a_key_is_sent_as_a_bearer_token():
    assert auth_headers(KEY) == {"Authorization": "Bearer s3cret-key"}


def test_completion_requests_carry_the_key():
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"token_ids": [5], "finish_reason": "stop",
                                                      "logprobs": {"token_logprobs": [-0.1], "tokens": ["token_id:5"]}}]})

    async def generate() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        client = EngineClient(engine_id="e", base_url="http://engine", model="m", stop_token_ids=[2], http=http,
                              api_key=KEY)
        await client.generate([1, 2, 3], 4, 0.8)
        await http.aclose()

    asyncio.run(generate())
    assert seen[0].headers["Authorization"] == "Bearer s3cret-key"


def test_the_server_gets_the_key_by_environment_and_an_inherited_one_is_not_used():
    settings, job = EngineSettings(), EngineJob(model=Path("m"), run="r", engine_id="e")
    assert server_environment({"PATH": "/bin"}, settings, job, KEY)[API_KEY_ENV] == "s3cret-key"
    assert API_KEY_ENV not in server_environment({API_KEY_ENV: "stale"}, settings, job, None)


def test_the_key_comes_from_the_environment_is_masked_when_shown_and_reaches_child_processes(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_AGENT_LOOP__ENGINE_API_KEY", "s3cret-key")
    cfg = load_config(None)
    assert cfg.agent_loop.engine_api_key == KEY
    assert "s3cret-key" not in repr(cfg.agent_loop)
    child = AgentLoopSettings.model_validate(json.loads(settings_json(cfg.agent_loop)))
    assert child.engine_api_key == KEY
