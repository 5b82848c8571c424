"""Kafka with SASL/SCRAM on the real broker: infra/kafka.sh's SCRAM listener, a user this test creates.
A whole training run over SCRAM is test_up_end_to_end's first test."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.scram import client_environment, scram_user
from pipeline.run.config import REPO_ROOT


def _smoke(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "smoke", "--json"], cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_a_scram_user_sends_and_reads_every_event_type_and_a_wrong_password_is_refused_in_one_line(infra):
    with scram_user(infra.kafka) as (user, password):
        done = _smoke(client_environment(infra.kafka, user, password))
        assert done.returncode == 0, done.stderr[-3000:]

        refused = _smoke(client_environment(infra.kafka, user, password + "-wrong"))
        assert refused.returncode == 2
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "refused the credentials of" in lines[0] and user in lines[0], refused.stderr
        assert password not in refused.stderr


def test_a_user_the_broker_does_not_know_is_refused(infra):
    env = client_environment(infra.kafka, "nobody", "nothing")
    refused = _smoke(env)
    assert refused.returncode == 2 and "refused the credentials of 'nobody'" in refused.stderr, refused.stderr
