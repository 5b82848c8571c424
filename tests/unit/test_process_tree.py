"""The process tree below a sandbox, as env_workers/sandbox/bwrap.py walks it to find a sandbox's
init and to kill what a command left running."""

from __future__ import annotations

import subprocess
import time

import pytest

from env_workers.sandbox import bwrap


@pytest.fixture
def tree():
    """sh -> sleep, and sh -> sh -> sleep: three descendants, one of them two levels down."""
    top = subprocess.Popen(["sh", "-c", "sleep 30 & (sleep 31 & wait) & wait"])
    deadline = time.monotonic() + 10
    while len(bwrap._children_map().get(top.pid, [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the inner sh's sleep
    yield top
    for pid in bwrap.descendants(top.pid):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    top.kill()
    top.wait()


def test_descendants_walk_the_kernels_children_files_and_agree_with_a_scan_of_all_of_proc(tree, monkeypatch):
    assert bwrap.HAS_CHILDREN_FILES  # Linux with CONFIG_PROC_CHILDREN, as every distribution kernel has
    walked = bwrap.descendants(tree.pid)
    monkeypatch.setattr(bwrap, "HAS_CHILDREN_FILES", False)
    scanned = bwrap.descendants(tree.pid)
    assert sorted(walked) == sorted(scanned) and len(walked) == 3
    assert sorted(bwrap._comm(pid) for pid in walked) == ["sh", "sleep", "sleep"]
    # parents before children: the inner sh comes before its sleep
    inner = next(pid for pid in walked if bwrap._comm(pid) == "sh")
    assert walked.index(inner) < walked.index(bwrap.children_of(inner)[0])


def test_a_process_that_is_gone_has_no_children():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert bwrap.children_of(gone.pid) == [] and bwrap.descendants(gone.pid) == []
