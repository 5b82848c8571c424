"""The vLLM plugin that makes an engine's processes sleep between polls instead of spinning (pipeline/engine/poll.py)."""

import time
from importlib.metadata import entry_points

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from pipeline.engine import poll
from pipeline.engine.poll import POLL_SLEEP_ENV, poll_sleep_s


def test_vllm_finds_the_plugin_among_its_general_plugins():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["rollstream_engine_poll"] == "pipeline.engine.poll:register"


def test_an_unset_or_zero_sleep_leaves_vllms_loop_as_it_is(monkeypatch):
    original = shm_broadcast.sched_yield
    for value in (None, "", "0"):
        if value is None:
            monkeypatch.delenv(POLL_SLEEP_ENV, raising=False)
        else:
            monkeypatch.setenv(POLL_SLEEP_ENV, value)
        poll.register()
        assert shm_broadcast.sched_yield is original


def test_a_positive_sleep_replaces_the_yield_in_vllms_polling_loop_with_that_sleep(monkeypatch):
    monkeypatch.setattr(shm_broadcast, "sched_yield", shm_broadcast.sched_yield)  # restored after the test
    monkeypatch.setenv(POLL_SLEEP_ENV, "0.02")
    poll.register()
    started = time.monotonic()
    shm_broadcast.sched_yield()
    assert 0.015 <= time.monotonic() - started < 1.0


@pytest.mark.parametrize("raw", ["fast", "-0.1", "1", "nan"])
def test_a_sleep_that_is_not_a_short_non_negative_number_is_refused_in_one_line(raw):
    with pytest.raises(ValueError, match=POLL_SLEEP_ENV):
        poll_sleep_s({POLL_SLEEP_ENV: raw})


def test_a_vllm_without_the_yield_it_patches_fails_loudly(monkeypatch):
    monkeypatch.delattr(shm_broadcast, "sched_yield")
    monkeypatch.setenv(POLL_SLEEP_ENV, "0.001")
    with pytest.raises(RuntimeError, match="no longer calls sched_yield"):
        poll.register()
