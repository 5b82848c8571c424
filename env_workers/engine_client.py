"""Async client of one vLLM engine's OpenAI-compatible /v1/completions: token ids in, token ids
and sampling log-probs out. No text crosses this boundary, so nothing is ever re-tokenized.

What vLLM 0.32 needs for that (vllm/entrypoints/openai/completion/protocol.py and serving.py):
`prompt` as a list of ids; `return_token_ids: true` puts the sampled ids in `choices[0].token_ids`;
`logprobs: 0` returns the sampled token's log-prob in `choices[0].logprobs.token_logprobs`;
`return_tokens_as_token_ids: true` names tokens `token_id:N` (a fallback source of the ids);
`stop_token_ids` = eos, and the stop token is included in the ids, with its log-prob.
The engine must run with `--logprobs-mode processed_logprobs`: vLLM's default (`raw_logprobs`)
reports log-probs *before* temperature, which are not the behaviour policy the loss needs.

An engine started with an API key (vLLM's `--api-key`, given to `rollstream engine`'s server as
VLLM_API_KEY) refuses /v1 requests without `Authorization: Bearer KEY` (401); `auth_headers` makes
that header, which this client and every other caller of an engine send.

Which weights produced a response: the engine's `x-rollstream-weight-version` response header
when it sets one (exact, taken when the request finished), else the version this client was last
told (`weight_version`, kept current by its owner from the engine's heartbeats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

WEIGHT_VERSION_HEADER = "x-rollstream-weight-version"
_TOKEN_ID_PREFIX = "token_id:"


class EngineError(Exception):
    """A completion failed; `retryable` is False when sending the same request again cannot help."""

    def __init__(self, message: str, *, engine_id: str = "", retryable: bool = True) -> None:
        super().__init__(message)
        self.engine_id = engine_id
        self.retryable = retryable


def auth_headers(api_key: SecretStr | None) -> dict[str, str]:
    """The headers a request to an engine needs: the bearer token when engines require a key, else none."""
    key = api_key.get_secret_value() if api_key is not None else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class Generation:
    """One engine answer: the sampled ids and their log-probs, and who produced them."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine_id: str
    weight_version: int


def completion_request(
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    temperature: float,
    stop_token_ids: Sequence[int],
    allowed_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The /v1/completions body. top_p, top_k and penalties are pinned off so the served model's
    generation_config cannot change the sampling distribution behind the loss's back."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,
    }
    if allowed_token_ids is not None:
        body["allowed_token_ids"] = list(allowed_token_ids)
    return body


def parse_completion(body: dict[str, Any], engine_id: str) -> tuple[list[int], list[float], str]:
    """(token ids, log-probs, finish reason) of a /v1/completions response; EngineError when malformed."""
    try:
        choice = body["choices"][0]
        logprobs = choice["logprobs"]
        token_logprobs = [float(value) for value in logprobs["token_logprobs"]]
        ids = choice.get("token_ids")
        if ids is None:
            ids = [int(token.removeprefix(_TOKEN_ID_PREFIX)) for token in logprobs["tokens"]]
        finish_reason = str(choice.get("finish_reason") or "")
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise EngineError(f"malformed completion response: {error!r}", engine_id=engine_id) from error
    if len(ids) != len(token_logprobs):
        raise EngineError(f"{len(ids)} token ids but {len(token_logprobs)} log-probs", engine_id=engine_id)
    if not ids:
        raise EngineError("the engine returned no tokens", engine_id=engine_id)
    return [int(i) for i in ids], token_logprobs, finish_reason


class EngineClient:
    """One engine. Share an httpx.AsyncClient across engines to pool connections; `aclose` closes it."""

    def __init__(
        self,
        *,
        engine_id: str,
        base_url: str,
        model: str,
        stop_token_ids: Sequence[int],
        weight_version: int = 0,
        timeout_s: float = 600.0,
        allowed_token_ids: Sequence[int] | None = None,
        http: httpx.AsyncClient | None = None,
        api_key: SecretStr | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        self.weight_version = weight_version
        self.timeout_s = timeout_s
        # Constrained sampling (vLLM's allowed_token_ids); the log-probs are then those of the
        # restricted distribution, which a learner must reproduce with the same mask.
        self.allowed_token_ids = list(allowed_token_ids) if allowed_token_ids is not None else None
        self._http = http or httpx.AsyncClient()
        self._headers = auth_headers(api_key)  # per request: the AsyncClient may be shared with other engines

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float,
                       *, seed: int | None = None) -> Generation:
        """Samples up to `max_tokens` ids after `prompt_ids` (with vLLM's per-request `seed` when
        given, for reproducible re-rollouts on engines that support it); raises EngineError on
        any failure."""
        request = completion_request(
            self.model, prompt_ids, max_tokens, temperature, self.stop_token_ids, self.allowed_token_ids
        )
        if seed is not None:
            request["seed"] = seed
        try:
            response = await self._http.post(f"{self.base_url}/v1/completions", json=request, headers=self._headers,
                                           timeout=self.timeout_s)
        except httpx.TimeoutException as error:
            raise EngineError(f"{self.engine_id}: timed out after {self.timeout_s} s", engine_id=self.engine_id) from error
        except httpx.HTTPError as error:
            raise EngineError(f"{self.engine_id}: unreachable: {error!r}", engine_id=self.engine_id) from error
        if response.status_code != 200:
            # 4xx (a prompt over the engine's context, a bad parameter) fails again on any retry.
            raise EngineError(
                f"{self.engine_id}: HTTP {response.status_code}: {response.text[:500]}",
                engine_id=self.engine_id, retryable=response.status_code >= 500 or response.status_code == 429,
            )
        try:
            body = response.json()
        except ValueError as error:
            raise EngineError(f"{self.engine_id}: response is not JSON", engine_id=self.engine_id) from error
        ids, logprobs, finish_reason = parse_completion(body, self.engine_id)
        if len(ids) > max_tokens:
            raise EngineError(f"{self.engine_id}: {len(ids)} tokens for max_tokens {max_tokens}", engine_id=self.engine_id)
        header = response.headers.get(WEIGHT_VERSION_HEADER)
        version = int(header) if header is not None and header.lstrip("-").isdigit() else self.weight_version
        return Generation(ids, logprobs, finish_reason, self.engine_id, version)

    async def aclose(self) -> None:
        await self._http.aclose()


def served_model(url: str, api_key: SecretStr | None = None) -> str:
    """The model id an OpenAI-compatible server serves (its first /v1/models entry)."""
    response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=auth_headers(api_key), timeout=10)
    return response.json()["data"][0]["id"]
