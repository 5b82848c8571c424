"""Who may reach an engine: engines bind to loopback unless told otherwise, and an API key set in
`agent_loop.engine_api_key` is required by the engine's vLLM server (its OpenAI routes and our weight
routes) and sent by its callers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
from pydantic import SecretStr

from env_workers.engine_client import EngineClient, auth_headers
from env_workers.settings import AgentLoopSettings
from pipeline.engine.server import WeightVersionMiddleware
from pipeline.engine.supervisor import API_KEY_ENV, EngineJob, EngineSettings, server_environment
from pipeline.engine.updates import EngineControl
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


class _Engine:
    """vLLM's engine client as the middleware calls it; counts the collective calls that reach it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, kwargs: dict) -> list[dict]:
        self.calls.append(method)
        return [{"ok": True}]


def _control(method: str, path: str, headers: list[tuple[bytes, bytes]], engine: _Engine) -> int:
    """The status the engine's middleware answers a control request with."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"body": json.dumps({"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2}).encode()}

    async def send(message: dict) -> None:
        sent.append(message)

    async def inner(scope, receive, send) -> None:  # the OpenAI app; control routes never reach it
        raise AssertionError("a control route reached the app")

    scope = {"type": "http", "method": method, "path": path, "headers": headers,
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}
    asyncio.run(WeightVersionMiddleware(inner)(scope, receive, send))
    return sent[0]["status"]


def test_with_a_key_the_weight_routes_refuse_a_request_without_it_and_nothing_reaches_the_engine(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret-key")
    engine = _Engine()
    assert _control("POST", "/rollstream/join", [], engine) == 401
    assert _control("POST", "/rollstream/join", [(b"authorization", b"Bearer wrong")], engine) == 401
    assert engine.calls == []
    assert _control("POST", "/rollstream/join", [(b"authorization", b"Bearer s3cret-key")], engine) == 200
    assert engine.calls == ["rollstream_join"]


def test_the_state_route_stays_open_for_probes_and_without_a_key_every_route_is(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret-key")
    assert _control("GET", "/rollstream/state", [], _Engine()) == 200
    monkeypatch.delenv(API_KEY_ENV)
    engine = _Engine()
    assert _control("POST", "/rollstream/join", [], engine) == 200 and engine.calls == ["rollstream_join"]


def test_the_weight_routes_client_sends_the_key(monkeypatch):
    seen: list[str | None] = []
    real_client = httpx.Client

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(200, json={"ok": True, "version": 3})

    monkeypatch.setattr(httpx, "Client", lambda **kwargs: real_client(transport=httpx.MockTransport(answer), **kwargs))
    EngineControl("http://engine", api_key=KEY).load(3, Path("/v3"))
    EngineControl("http://engine").load(3, Path("/v3"))
    assert seen == ["Bearer s3cret-key", None]
