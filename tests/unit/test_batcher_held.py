"""The batcher with its learner held (SIGSTOP) and then its dispatcher held, as bench pipeline's
stages run once did: why no third batch was ever cut from its 48 ready groups.

Not a fault of the batcher state: AgentRL's rule (streams/batching.py) takes *all* ready
trajectories when the learner's credit arrives. With the learner held after version 0, the first
batch takes the first batch_size groups (it needs no credit) and every later group waits for
version 1; version 1's credit then cuts one batch of all of them, and version 2's credit finds
nothing ready. With the dispatcher held no group ever arrives again, so the learner waits for ever.
"""

from __future__ import annotations

from helpers.events import weights

from schemas import samples
from schemas.codec import codec
from streams import batcher_state as bat
from streams.settings import StreamsSettings

# a bench pipeline's batching (configs/pipeline.yaml's until 2026-12-05): groups of 2, batches of 3 groups,
# a first batch of one batch
PIPELINE = StreamsSettings(group_size=2, batch_size=3, stale_step=2, first_batch_factor=1.0, group_timeout_s=300)
HELD_GROUPS = 48  # what the stages run let out: 2 x 16 warm-up groups + 16 measured
T0 = 1_000_000


def _group(gid: str) -> bytes:
    g = {**samples.group(), "group_id": gid, "run": "r", "group_size": 2,
         "members": [{"trajectory": {**samples.trajectory(m), "group_id": gid, "run": "r"}, "advantage": float(m),
                      "masked": False} for m in range(2)]}
    return codec().encode("group", g)


def _version(v: int) -> bytes:
    return codec().encode("weight_version", weights("r", v))


def _cut(tables: bat.BatcherTables, data: bytes) -> list[dict]:
    outs, _ = bat.on_batcher_event(tables, data, T0, PIPELINE)
    return [codec().decode(value, "batch") for _, _, value in outs]


def _held_learner_run() -> tuple[bat.BatcherTables, list[dict]]:
    """Version 0, then every held group arrives while the learner is stopped."""
    tables = bat.BatcherTables({}, {}, {})
    cuts = _cut(tables, _version(0))
    for g in range(HELD_GROUPS):
        cuts += _cut(tables, _group(f"g{g}"))
    return tables, cuts


def test_a_held_learner_gets_one_batch_and_every_later_group_waits_for_its_next_version():
    tables, cuts = _held_learner_run()
    assert [b["group_ids"] for b in cuts] == [["g0", "g1", "g2"]]
    assert len(tables.queue) == HELD_GROUPS - 3 and bat.credit(tables.state["r"]) is None


def test_the_version_after_the_hold_takes_every_ready_group_into_one_batch():
    tables, _ = _held_learner_run()
    [second] = _cut(tables, _version(1))
    assert len(second["group_ids"]) == HELD_GROUPS - 3 and len(second["items"]) == 2 * (HELD_GROUPS - 3)
    assert tables.queue == {} and tables.ready == {} and tables.state["r"]["available"] == 0


def test_with_the_dispatcher_held_the_third_version_finds_no_group_to_cut():
    tables, _ = _held_learner_run()
    _cut(tables, _version(1))
    assert _cut(tables, _version(2)) == []  # credit is open, nothing is ready: the learner waits
    assert bat.credit(tables.state["r"]) == 2
    [third] = _cut(tables, _group("late-0")) + _cut(tables, _group("late-1")) + _cut(tables, _group("late-2"))
    assert third["group_ids"] == ["late-0", "late-1", "late-2"]  # the next let-out groups are cut at once
