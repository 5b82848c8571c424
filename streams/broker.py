"""How the streams worker's Kafka clients are configured: security (SSL, SASL) and the producer's
and consumer's options, from the cluster's KafkaSettings and the worker's settings.

Our names inside, Faust's keyword arguments only here (the App factory passes them through).
"""

from __future__ import annotations

import ssl
from typing import Any

import faust

from schemas.settings import KafkaSettings
from streams.settings import WorkerSettings

SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""The SASL mechanisms Faust's aiokafka driver speaks."""

RECORD_OVERHEAD_BYTES = 64 * 1024
"""Room left under Kafka's message limit for the key and the record and batch headers."""


def broker_credentials(kafka: KafkaSettings) -> faust.auth.Credentials | None:
    """Faust's broker credentials for the cluster's security settings (None: PLAINTEXT). A CA file
    in the librdkafka extras (ssl.ca.location) verifies the brokers; else the system's CAs do."""
    protocol = kafka.security_protocol.upper()
    if protocol == "PLAINTEXT":
        return None
    if protocol not in ("SSL", "SASL_PLAINTEXT", "SASL_SSL"):
        raise ValueError(f"security_protocol {kafka.security_protocol!r}: "
                         "use PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    context = (ssl.create_default_context(cafile=kafka.extra.get("ssl.ca.location"))
               if protocol in ("SSL", "SASL_SSL") else None)
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    mechanism = (kafka.sasl_mechanism or "").upper()
    if mechanism not in SASL_MECHANISMS:
        raise ValueError(f"sasl_mechanism {kafka.sasl_mechanism!r}: the streams worker speaks "
                         f"{', '.join(SASL_MECHANISMS)}")
    return faust.SASLCredentials(username=kafka.sasl_username,
                                 password=kafka.sasl_password.get_secret_value() if kafka.sasl_password else None,
                                 mechanism=mechanism, ssl_context=context)


def client_options(kafka: KafkaSettings, worker: WorkerSettings) -> dict[str, Any]:
    """faust.App keyword arguments of the broker connection, the producer and the consumer. acks=-1:
    a send counts once every in-sync replica has it (the delivery rules need it durable)."""
    return {
        "broker": kafka.faust_broker,
        "broker_credentials": broker_credentials(kafka),
        "producer_acks": -1,
        "producer_compression_type": None if worker.producer_compression == "none" else worker.producer_compression,
        "producer_max_request_size": kafka.message_max_bytes,
        "consumer_max_fetch_size": kafka.message_max_bytes,
        "broker_session_timeout": worker.session_timeout_s,
        "broker_heartbeat_interval": 1,
    }


def batch_limit_bytes(kafka: KafkaSettings, worker: WorkerSettings) -> int:
    """The encoded size above which a batch is claim-checked: the worker's setting, but always
    under what the producer may send."""
    return min(worker.batch_offload_bytes, kafka.message_max_bytes - RECORD_OVERHEAD_BYTES)
