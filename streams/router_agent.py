"""Router: tasks.requested + engines + weights -> tasks, each with its per-turn pool plan.

The plan comes from routing.plan_turn_pools; this module only keeps the engine registry and the
learner version per run in a table and moves events. Heartbeats and weight versions are
broadcast into every partition of the router's internal topic, so each partition holds its own
copy of the registry (table key "p<partition>") next to the requests it routes.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from schemas import topics
from schemas.codec import codec
from streams import routing
from streams.app import Out, Wiring
from streams.serde import decode_from, encode_for, tagged_table
from streams.settings import StreamsSettings

REQUEST, HEARTBEAT, WEIGHTS = "task_requested", "engine_heartbeat", "weight_version"


def partition_key(partition: int) -> str:
    return f"p{partition}"


def empty_state() -> dict[str, Any]:
    return {"registry": {}, "versions": {}}


def on_router_event(state_table: MutableMapping[str, Any], data: bytes, partition: int, now_ms: int,
                    settings: StreamsSettings) -> list[Out]:
    """Applies one event of the router's internal topic; returns the tasks event(s) to send."""
    kind = codec().event_type_of(data)
    key = partition_key(partition)
    state = state_table.get(key) or empty_state()
    if kind == HEARTBEAT:
        state = {**state, "registry": routing.fold_heartbeat(state["registry"], codec().decode(data, HEARTBEAT))}
        state_table[key] = state
        return []
    if kind == WEIGHTS:
        w = codec().decode(data, WEIGHTS)
        held = state["versions"].get(w["run"], 0)
        if w["version"] > held:
            state_table[key] = {**state, "versions": {**state["versions"], w["run"]: w["version"]}}
        return []
    request = codec().decode(data, REQUEST)
    pools = routing.pool_states(state["registry"], now_ms, int(settings.engine_liveness_s * 1000))
    plan = routing.plan_turn_pools(
        request["run"], request["group_id"], request["member"], settings.max_turns, settings.stale_ratio,
        pools[routing.STALE], request["validation"], settings.max_stale_lag,
        learner_version=state["versions"].get(request["run"], 0), stale_step=settings.stale_step)
    task = routing.task_event(request, plan, now_ms)
    return [(topics.TASKS, request["group_id"].encode(), encode_for(topics.TASKS, task))]


def register(w: Wiring) -> None:
    """Declares the router's intake agents, its table and the routing agent on the app."""
    parts = w.worker.partitions
    router_in = w.internal_topic("router", parts)
    table = tagged_table(w.app, "router-state", parts, w.topic_config)

    @w.app.agent(w.raw_topic(topics.TASKS_REQUESTED), name="router-requests-intake")
    async def requests_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                request = decode_from(topics.TASKS_REQUESTED, event.value)
                if w.serves(request):
                    await router_in.send(key=request["group_id"].encode(), value=event.value)
            await w.guarded(event, "router-requests-intake", forward)

    @w.app.agent(w.raw_topic(topics.ENGINES), name="router-engines-intake")
    async def engines_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                heartbeat = decode_from(topics.ENGINES, event.value)
                if routing.serves_run(heartbeat, w.worker.run):  # another run's engines hold other weights
                    await w.broadcast(router_in, parts, heartbeat["engine_id"].encode(), event.value)
            await w.guarded(event, "router-engines-intake", forward)

    @w.app.agent(w.raw_topic(topics.WEIGHTS), name="router-weights-intake")
    async def weights_intake(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def forward(event=event) -> None:
                version = decode_from(topics.WEIGHTS, event.value)
                if w.serves(version):
                    await w.broadcast(router_in, parts, version["run"].encode(), event.value)
            await w.guarded(event, "router-weights-intake", forward)

    @w.app.agent(router_in, name="router")
    async def router(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def route(event=event) -> None:
                await w.send(on_router_event(table, event.value, event.message.partition, w.clock(), w.settings))
            await w.guarded(event, "router", route)
