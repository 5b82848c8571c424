"""The recording proxy's HTTP layer (aiohttp.web): routes, JSON in and out, OpenAI error bodies. The logic
is env_workers/proxy.py; Kafka and the engines' heartbeats are wired by pipeline/run/proxy.py.

Routes (the protocol: env_workers/proxy.py and ARCHITECTURE.md "The recording proxy"):
    POST   /episodes                                  open an episode -> {episode_id, base_path, ...}
    POST   /episodes/{id}/v1/chat/completions         one call (an OpenAI client's base_url: .../episodes/{id}/v1)
    POST   /episodes/{id}/end                         {reward, status, score, metrics} -> trajectory published
    DELETE /episodes/{id}                             abandon: nothing published
    (an episode idle longer than proxy.idle_timeout_s is ended by the server, published as task_error)
    GET    /health                                    open episodes and counts

No request crashes the server: a bad one is an HTTP 400 (404 for an unknown episode) whose body is
OpenAI's `{"error": {"message": ...}}` with a one-line message; no engine is a 503; anything else a 500,
logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from env_workers.proxy import (
    EngineUnavailable, Episodes, RequestError, completion_response, error_body, parse_chat_request, response_id,
    sse, stream_chunks,
)

log = logging.getLogger(__name__)

IDLE_SWEEP_MAX_S = 5.0
"""Longest wait between two looks for idle episodes (a quarter of proxy.idle_timeout_s when that is shorter)."""
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body: a long agent history; Kafka's message limit bounds what a trajectory can hold anyway."""


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message.splitlines()[0] if message else code, code, param), status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as error:
        return _error(error.status, str(error), error.code, error.param)
    except EngineUnavailable as error:
        return _error(503, f"no engine answered: {error}", "engine_unavailable")
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error(error.status, f"{request.method} {request.path}: {error.reason}", "http_error")
    except Exception as error:  # a bug or a broken template: the request fails, the server goes on
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(error).__name__}: {error}", "internal_error")


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not JSON: {error}") from error


def make_app(episodes: Episodes, *, model: str, clock: Callable[[], float],
             flush: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    """The proxy's application over `episodes`. `flush` runs after a trajectory is handed to its sink and
    before the caller hears the episode ended (the Kafka producer's flush: the end is acknowledged once
    the broker has the trajectory)."""
    locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # one call of an episode at a time

    async def open_episode(request: web.Request) -> web.Response:
        return web.json_response(episodes.open_episode(await _json(request)))

    async def chat(request: web.Request) -> web.StreamResponse:
        episode_id = request.match_info["episode_id"]
        chat_request = parse_chat_request(await _json(request))
        episode = episodes.get(episode_id)  # first: an unknown id must leave no lock behind
        async with locks[episode_id]:
            completion = await episode.complete(chat_request)
        created, rid = int(clock()), response_id()
        if chat_request.stream:
            chunks = stream_chunks(completion, model, created, rid, chat_request.include_usage)
            return web.Response(body=sse(chunks), content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return web.json_response(completion_response(completion, model, created, rid))

    async def end(request: web.Request) -> web.Response:
        episode_id = request.match_info["episode_id"]
        body = await _json(request)
        episodes.get(episode_id)
        async with locks[episode_id]:
            result = episodes.end(episode_id, body)
        locks.pop(episode_id, None)
        if flush is not None:
            await flush()
        return web.json_response(result)

    async def cancel(request: web.Request) -> web.Response:
        episode_id = request.match_info["episode_id"]
        episodes.get(episode_id)
        async with locks[episode_id]:
            result = episodes.cancel(episode_id)
        locks.pop(episode_id, None)
        return web.json_response(result)

    async def expire_idle(app: web.Application):
        """Ends idle episodes (ProxySettings.idle_timeout_s) every few seconds while the server runs."""
        interval = min(episodes.settings.idle_timeout_s / 4, IDLE_SWEEP_MAX_S)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(interval)
                ended = episodes.expire_idle(clock(), busy=lambda i: i in locks and locks[i].locked())
                for episode_id in ended:
                    locks.pop(episode_id, None)
                if ended and flush is not None:
                    await flush()

        task = asyncio.create_task(sweep())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"open": len(episodes.open), **episodes.counts})

    async def no_episode(request: web.Request) -> web.Response:
        raise RequestError("no episode in the path: open one with POST /episodes and use "
                           "/episodes/{episode_id}/v1 as the client's base_url", code="episode_not_found", status=404)

    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app.cleanup_ctx.append(expire_idle)
    app.add_routes([
        web.post("/episodes", open_episode),
        web.post("/episodes/{episode_id}/v1/chat/completions", chat),
        web.post("/episodes/{episode_id}/end", end),
        web.delete("/episodes/{episode_id}", cancel),
        web.get("/health", health),
        web.post("/v1/chat/completions", no_episode),
    ])
    return app
