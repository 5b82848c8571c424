"""The run configuration: composes every component's settings model, and is the only place that
reads the environment and configuration files.

Sources, highest first: environment variables (ROLLSTREAM_ prefix, nested
fields joined with "__", e.g. ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS), a YAML file, the defaults.
The local infrastructure's own variables (KAFKA_HOST/KAFKA_PORT, MINIO_HOST/MINIO_PORT,
MINIO_ROOT_USER/MINIO_ROOT_PASSWORD, read by infra/*.sh) are honoured too, so one export moves
both the servers and the clients.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.settings import KafkaSettings, ObjectStoreSettings

REPO_ROOT = Path(__file__).resolve().parents[1]


class RollstreamConfig(BaseSettings):
    """Everything one rollstream run is configured by."""

    model_config = SettingsConfigDict(env_prefix="ROLLSTREAM_", env_nested_delimiter="__", frozen=True, extra="forbid")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):  # type: ignore[no-untyped-def]
        # The environment wins over what load_config passes in (the YAML file); no .env files.
        return (env_settings, init_settings)

    run: str = "local"
    """Run id stamped on every event of the run."""
    kafka: KafkaSettings = KafkaSettings()
    """Event bus connection."""
    object_store: ObjectStoreSettings = ObjectStoreSettings()
    """Object store connection (weights, checkpoints, large payloads)."""


def _infra_env() -> dict[str, Any]:
    """Client settings implied by the infrastructure scripts' variables, when they are set."""
    env = os.environ
    out: dict[str, Any] = {}
    if "KAFKA_HOST" in env or "KAFKA_PORT" in env:
        out.setdefault("kafka", {})["bootstrap_servers"] = f"{env.get('KAFKA_HOST', '127.0.0.1')}:{env.get('KAFKA_PORT', '9092')}"
    store: dict[str, Any] = {}
    if "MINIO_HOST" in env or "MINIO_PORT" in env:
        store["endpoint"] = f"{env.get('MINIO_HOST', '127.0.0.1')}:{env.get('MINIO_PORT', '9000')}"
    if "MINIO_ROOT_USER" in env:
        store["access_key"] = env["MINIO_ROOT_USER"]
    if "MINIO_ROOT_PASSWORD" in env:
        store["secret_key"] = env["MINIO_ROOT_PASSWORD"]
    if store:
        out["object_store"] = store
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Path | None = None) -> RollstreamConfig:
    """Builds the configuration: ROLLSTREAM_ environment variables over the infrastructure
    scripts' variables over a YAML file over the defaults."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the configuration must be a YAML mapping")
        data = loaded
    return RollstreamConfig(**_merge(data, _infra_env()))
