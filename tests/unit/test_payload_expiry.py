"""The payload bucket's expiration, derived from the `batches` topic's retention (pipeline/run/infra.py)."""

from __future__ import annotations

import pytest

from pipeline.run.infra import expiration_days


@pytest.mark.parametrize("retention_ms,days", [
    (604_800_000, 7),             # infra/topics.yaml's 7 days
    (604_800_001, 8),             # a millisecond more needs a whole day more
    (3_600_000, 1),               # an hour still keeps the object a day
    (0, 1),
])
def test_payloads_expire_after_the_retention_rounded_up_to_whole_days(retention_ms, days):
    assert expiration_days(retention_ms) == days


def test_payloads_of_a_topic_that_keeps_events_forever_never_expire():
    assert expiration_days(-1) is None
