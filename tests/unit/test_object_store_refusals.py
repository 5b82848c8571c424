"""Writes the object store refuses for a reason that passes (a drive under MinIO's free-space
threshold, throttling) are retried until a deadline; any other refusal fails at once. Found by
`bench chaos`: with the disk nearly full, MinIO answered XMinioStorageFull and the learner exited
(five restarts in one run) instead of waiting for space."""

from __future__ import annotations

import pytest
from minio.error import S3Error

from pipeline.cli.toolkit import App
from schemas import objectstore


def refusal(code: str) -> S3Error:
    return S3Error(None, code, "refused", "/bucket/key", "req", "host")  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_full_store_is_waited_out_with_growing_pauses_then_the_write_goes_through():
    answers = [refusal("XMinioStorageFull")] * 6 + [None]
    clock = Clock()

    def write() -> None:
        if (answer := answers.pop(0)) is not None:
            raise answer

    objectstore._write("s3://b/k", write, deadline_s=600, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.slept == [1, 2, 4, 8, 15, 15] and answers == []


def test_a_store_that_stays_full_past_the_deadline_raises_its_own_error():
    clock = Clock()

    def write() -> None:
        raise refusal("XMinioStorageFull")

    with pytest.raises(S3Error) as raised:
        objectstore._write("s3://b/k", write, deadline_s=60, sleep=clock.sleep, clock=lambda: clock.now)
    assert raised.value.code == "XMinioStorageFull" and 60 <= clock.now < 75


def test_a_refusal_that_does_not_pass_by_itself_fails_at_once():
    clock = Clock()

    def write() -> None:
        raise refusal("AccessDenied")

    with pytest.raises(S3Error):
        objectstore._write("s3://b/k", write, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.slept == []


def test_a_command_that_dies_of_a_store_error_dies_of_that_error_not_of_typer_marking_it():
    app = App()

    @app.command()
    def put() -> None:
        raise refusal("AccessDenied")

    @app.command()
    def other() -> None:
        pass

    with pytest.raises(S3Error) as raised:
        app(["put"], standalone_mode=False)
    assert raised.value.code == "AccessDenied"
