"""Router: tasks.requested + engines + weights -> tasks, each with its per-turn pool plan.

The plan comes from routing.plan_turn_pools; this module only keeps the engine registry and the
learner version per run in a table and moves events. The agent reads `tasks.requested` as it is
(keyed by group_id) together with the router's control topic: heartbeats and weight versions are
broadcast into every partition of the control topic, so each partition holds its own copy of the
registry (table key "p<partition>") next to the requests it routes.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from schemas import topics
from schemas.codec import codec
from streams import routing
from streams.app import Wiring
from streams.events import Out, decode_from, encode_for
from streams.serde import tagged_table
from streams.settings import StreamsSettings

REQUEST, HEARTBEAT, WEIGHTS = "task_requested", "engine_heartbeat", "weight_version"
FORGET_AFTER_LIVENESS = 10
"""An engine silent for this many liveness timeouts leaves the registry (it was dead long before)."""


def forget_after_ms(settings: StreamsSettings) -> int:
    """How long an engine may be silent before the registry forgets it (routing.fold_heartbeat)."""
    return int(FORGET_AFTER_LIVENESS * settings.engine_liveness_s * 1000)


def partition_key(partition: int) -> str:
    return f"p{partition}"


def empty_state() -> dict[str, Any]:
    return {"registry": {}, "versions": {}}


def on_router_event(state_table: MutableMapping[str, Any], data: bytes, partition: int, now_ms: int,
                    settings: StreamsSettings) -> list[Out]:
    """Applies one event (a request or a control event); returns the tasks event(s) to send."""
    kind = codec().event_type_of(data)
    if kind == REQUEST:
        return on_request(state_table, codec().decode(data, REQUEST), partition, now_ms, settings)
    on_control(state_table, data, partition, settings)
    return []


def on_control(state_table: MutableMapping[str, Any], data: bytes, partition: int, settings: StreamsSettings) -> None:
    """Folds an engine heartbeat or a weight version into this partition's state."""
    kind = codec().event_type_of(data)
    key = partition_key(partition)
    state = state_table.get(key) or empty_state()
    if kind == HEARTBEAT:
        registry = routing.fold_heartbeat(state["registry"], codec().decode(data, HEARTBEAT), forget_after_ms(settings))
        state_table[key] = {**state, "registry": registry}
    elif kind == WEIGHTS:
        w = codec().decode(data, WEIGHTS)
        if w["version"] > state["versions"].get(w["run"], 0):
            state_table[key] = {**state, "versions": {**state["versions"], w["run"]: w["version"]}}
    else:
        raise ValueError(f"the router's control topic carries heartbeats and weight versions, not {kind}")


def on_request(state_table: MutableMapping[str, Any], request: dict[str, Any], partition: int, now_ms: int,
               settings: StreamsSettings) -> list[Out]:
    """Plans one task request from this partition's registry; returns its tasks event."""
    state = state_table.get(partition_key(partition)) or empty_state()
    pools = routing.pool_states(state["registry"], now_ms, int(settings.engine_liveness_s * 1000))
    version = state["versions"].get(request["run"], 0)
    # validation keeps the full budget, so its success rates compare across the schedule's stages
    turns = settings.max_turns if request["validation"] else routing.turn_budget(
        version, settings.turn_schedule, settings.max_turns)
    plan = routing.plan_turn_pools(
        request["run"], request["group_id"], request["member"], turns, settings.stale_ratio,
        pools[routing.STALE], request["validation"], settings.max_stale_lag,
        learner_version=version, stale_step=settings.stale_step, mode=settings.routing_mode)
    task = routing.task_event(request, plan, now_ms)
    return [(topics.TASKS, request["group_id"].encode(), encode_for(topics.TASKS, task))]


def register(w: Wiring) -> None:
    """Declares the router's control intakes, its table and the routing agent on the app."""
    parts = w.worker.partitions
    source, control = w.with_control(topics.TASKS_REQUESTED, "router")
    table = tagged_table(w.app, "router-state", parts, w.topic_config)

    liveness_ms = int(w.settings.engine_liveness_s * 1000)
    forwarded: dict[str, dict[str, Any]] = {}  # engine_id -> its last heartbeat forwarded (by this process)

    def live_heartbeat(hb: dict[str, Any]) -> tuple[str, int] | None:
        nonlocal forwarded
        # Another run's engines hold other weights; a heartbeat older than the liveness timeout
        # never counts (routing.is_live), and most of a new app's history of `engines` is such.
        if not routing.serves_run(hb, w.worker.run) or w.clock() - hb["sent_at_ms"] > liveness_ms:
            return None
        # refreshed at a third of the liveness timeout: the router's copy is never near expiry
        if not routing.is_news(forwarded.get(hb["engine_id"]), hb, liveness_ms // 3):
            return None
        forwarded = routing.fold_heartbeat(forwarded, hb, forget_after_ms(w.settings))  # forgets as the registry does
        return hb["engine_id"], hb["sent_at_ms"]

    w.control_intake(topics.ENGINES, "router-engines-intake", control, parts, live_heartbeat)
    w.control_intake(topics.WEIGHTS, "router-weights-intake", control, parts, w.served_version)

    @w.app.agent(source, name="router")
    async def router(stream):  # type: ignore[no-untyped-def]
        async for event in stream.events():
            async def route(event=event) -> None:
                msg = event.message
                if msg.topic != topics.TASKS_REQUESTED:
                    on_control(table, event.value, msg.partition, w.settings)
                    return
                request = decode_from(topics.TASKS_REQUESTED, event.value)
                if w.serves(request):
                    await w.send(on_request(table, request, msg.partition, w.clock(), w.settings))
            await w.guarded(event, "router", route)
