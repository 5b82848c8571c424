"""A SASL/SCRAM user of the local broker (infra/kafka.sh opens a SCRAM listener beside its plaintext one),
created through the Admin API on the plaintext listener and deleted afterwards."""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from confluent_kafka.admin import (AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialDeletion,
                                   UserScramCredentialUpsertion)

from schemas.settings import KafkaSettings

MECHANISM = "SCRAM-SHA-512"


def sasl_bootstrap(kafka: KafkaSettings) -> str:
    """host:port of the broker's SCRAM listener: the plaintext listener's host, infra/env.sh's KAFKA_SASL_PORT."""
    host = kafka.bootstrap_servers.split(",")[0].rsplit(":", 1)[0]
    return f"{host}:{os.environ.get('KAFKA_SASL_PORT', '9094')}"


def client_environment(kafka: KafkaSettings, user: str, password: str) -> dict[str, str]:
    """The ROLLSTREAM_ variables that point every rollstream process at the SCRAM listener as `user`."""
    return {"ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": sasl_bootstrap(kafka),
            "ROLLSTREAM_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "ROLLSTREAM_KAFKA__SASL_MECHANISM": MECHANISM,
            "ROLLSTREAM_KAFKA__SASL_USERNAME": user,
            "ROLLSTREAM_KAFKA__SASL_PASSWORD": password}


@contextmanager
def scram_user(kafka: KafkaSettings) -> Iterator[tuple[str, str]]:
    """A new SCRAM-SHA-512 user with a random password, as (name, password); deleted on exit."""
    admin = AdminClient(kafka.as_confluent())
    user, password = f"rollstream-test-{uuid.uuid4().hex[:8]}", secrets.token_urlsafe(18)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
    for future in admin.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(user, info, password.encode())]).values():
        future.result(timeout=30)
    try:
        yield user, password
    finally:
        for future in admin.alter_user_scram_credentials(
                [UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_512)]).values():
            future.result(timeout=30)
