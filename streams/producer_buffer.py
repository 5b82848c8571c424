"""A patch of Faust's producer buffer: a commit waits until every table write is acknowledged.

Why: the delivery rules (ARCHITECTURE.md "Delivery guarantees") need whatever an agent wrote for an
event to be durable before the event's offset is committed. Faust flushes its producer before it
commits, but table writes (the changelogs) wait in a buffer whose flush gives up after 0.1 s
without progress, so a commit could pass changelog writes that were never acknowledged, and a
crashed worker's recovered table would lack writes whose events count as consumed.
`drain_before_commit` replaces that flush with one that waits for every buffered write, or raises
so that the commit which called it does not happen.
"""

from __future__ import annotations

import asyncio
from typing import Any

FLUSH_TIMEOUT_S = 120.0
"""How long a commit waits for buffered table writes to be acknowledged (a broker restart takes this long)."""
STOP_FLUSH_TIMEOUT_S = 10.0
"""The same wait while the worker stops (its producer may already be gone)."""


def drain_before_commit(buffer: Any) -> None:
    """Makes a Faust producer buffer's flush wait until every message put in it so far is
    acknowledged by the broker (or raise, so the commit that called it does not happen)."""
    pending: set[asyncio.Future] = set()
    put = buffer.put

    def tracked_put(fut: asyncio.Future) -> None:
        pending.add(fut)
        fut.add_done_callback(pending.discard)
        put(fut)

    async def flush() -> None:
        if not pending:
            return
        timeout = STOP_FLUSH_TIMEOUT_S if buffer.should_stop else FLUSH_TIMEOUT_S
        done, waiting = await asyncio.wait(list(pending), timeout=timeout)
        if waiting:
            raise RuntimeError(f"{len(waiting)} table changelog writes not acknowledged within {timeout:g} s")
        failed = [f.exception() for f in done if not f.cancelled() and f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} table changelog writes failed: {failed[0]!r}") from failed[0]

    # Faust's ProducerBuffer has no hook for this: its instance methods are replaced.
    buffer.put = tracked_put
    buffer.flush = flush
