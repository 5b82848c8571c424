"""Connection settings for the event bus and the object store, shared by every component.

Our names inside, each client's names only at the edge (`as_confluent`, `as_kafka_python`,
`faust_broker`). Values come from pipeline/run/config.py, the only place that reads the environment.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class KafkaSettings(BaseModel):
    """How to reach the Kafka cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list (the local broker of infra/kafka.sh by default)."""
    security_protocol: str = "PLAINTEXT"
    """PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
    sasl_mechanism: str | None = None
    """SASL mechanism when a SASL protocol is used, e.g. PLAIN or SCRAM-SHA-512."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password (masked when the settings are printed)."""
    message_max_bytes: int = 16 * 1024 * 1024
    """Largest event the producer sends; matches the topics' max.message.bytes."""
    compression: str = "zstd"
    """Producer compression codec (ARCHITECTURE.md: topics use zstd)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Further librdkafka properties, passed through untouched to confluent-kafka clients."""

    def as_confluent(self, **overrides: Any) -> dict[str, Any]:
        """librdkafka configuration for confluent-kafka producers, consumers and admin clients."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username or ""
            conf["sasl.password"] = self.sasl_password.get_secret_value() if self.sasl_password else ""
        conf.update(self.extra)
        conf.update(overrides)
        return conf

    def as_kafka_python(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for kafka-python clients."""
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = self.sasl_password.get_secret_value() if self.sasl_password else None
        kw.update(overrides)
        return kw

    @property
    def faust_broker(self) -> str:
        """Faust's broker URL list (kafka://host:port;host:port)."""
        return ";".join(f"kafka://{s.strip()}" for s in self.bootstrap_servers.split(","))


class ObjectStoreSettings(BaseModel):
    """How to reach the S3-compatible object store (local MinIO by default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str = "127.0.0.1:9000"
    """host:port of the S3 API (no scheme)."""
    access_key: str = "rollstream"
    """Access key (MINIO_ROOT_USER of the local server)."""
    secret_key: SecretStr = SecretStr("rollstream-local-secret")
    """Secret key (MINIO_ROOT_PASSWORD of the local server; masked when printed)."""
    secure: bool = False
    """Use TLS."""
    cert_check: bool = True
    """Verify the server certificate when secure."""
    region: str | None = None
    """Region, for stores that need one."""

    @model_validator(mode="after")
    def _no_default_credentials_off_this_host(self) -> ObjectStoreSettings:
        # A store other processes can reach must not open with a key pair published in this
        # repository or in MinIO's documentation (issue 28): whoever reaches it could replace a
        # weight version that engines then serve.
        host = endpoint_host(self.endpoint)
        if not loopback(host) and (self.access_key, self.secret_key.get_secret_value()) in DEFAULT_CREDENTIALS:
            raise ValueError(f"the default credentials ({self.access_key}) are refused for {host}, "
                             "which is not this host's loopback; set object_store.access_key and secret_key "
                             "(ROLLSTREAM_OBJECT_STORE__ACCESS_KEY, ROLLSTREAM_OBJECT_STORE__SECRET_KEY)")
        return self


DEFAULT_CREDENTIALS = frozenset({("rollstream", "rollstream-local-secret"), ("minioadmin", "minioadmin")})
"""Key pairs anyone can read: the local server's (infra/env.sh) and MinIO's own default."""


def endpoint_host(endpoint: str) -> str:
    """The host of a host:port endpoint ("[::1]:9000" gives "::1")."""
    host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 or endpoint.startswith("[") else endpoint
    return host.strip("[]")


def loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
