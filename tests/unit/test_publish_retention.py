"""The retention rule for staged versions: what engines, the stale pool and checkpoints still need."""

from __future__ import annotations

import pytest

from learner.publish import retained_versions, version_prefix


def keep(published, **kw):
    args = {"keep_last": 3, "stale_step": 25, "keep_stale": 2, "checkpoint_versions": ()} | kw
    return retained_versions(published, **args)


def test_the_newest_versions_are_kept_for_engines_that_missed_a_broadcast():
    assert keep(range(5, 10), stale_step=1000) == {7, 8, 9}


def test_the_stale_pool_keeps_the_newest_multiples_of_stale_step():
    assert keep(range(0, 61)) == {58, 59, 60, 50, 25}


def test_a_version_a_checkpoint_names_is_never_pruned():
    assert keep(range(0, 61), checkpoint_versions=[31, 44]) == {58, 59, 60, 50, 25, 31, 44}


def test_a_checkpoint_version_already_pruned_is_not_resurrected():
    assert keep([40, 41, 42], checkpoint_versions=[3]) == {40, 41, 42}


def test_version_zero_is_the_stale_pool_start_until_a_newer_multiple_exists():
    assert keep(range(0, 10)) == {0, 7, 8, 9}


def test_keeping_no_version_is_refused():
    with pytest.raises(ValueError):
        keep(range(3), keep_last=0)


def test_versions_live_under_the_run_with_six_digit_numbers():
    assert version_prefix("r1", 7) == "r1/v000007/"


def test_every_version_a_kept_delta_is_built_on_is_kept():
    # Snapshots every 10 versions: 57 is a delta on 50..56, so an engine holding nothing can load it.
    chains = {v: tuple(range(v - v % 10, v + 1)) for v in range(0, 61) if v % 10}
    kept = keep(range(0, 58), chains=chains)
    assert kept == {55, 56, 57, 50, 51, 52, 53, 54, 25, 20, 21, 22, 23, 24}


def test_a_full_version_keeps_nothing_else_and_a_chain_never_resurrects_a_pruned_version():
    assert keep(range(40, 43), chains={41: (40, 41), 42: (40, 41, 42)}) == {40, 41, 42}
    assert keep(range(45, 48), stale_step=1000, chains={47: tuple(range(40, 48))}) == {45, 46, 47}
