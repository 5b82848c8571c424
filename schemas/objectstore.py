"""The object store, spoken through the `minio` SDK so any S3-compatible server works.

Objects are addressed as `s3://bucket/key` URIs inside events. An event too large for one Kafka
message travels as a claim check: the whole event, encoded, is an object, and the event on the
topic carries payload_uri, payload_sha256 and payload_bytes with its bulky fields left empty
(`claim_check`, `resolve_claim_check`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from minio import Minio
from minio.error import S3Error

from schemas.codec import codec
from schemas.settings import ObjectStoreSettings

# MinIO's SDK uploads in parts of this size above it; 16 MiB keeps memory bounded.
PART_SIZE = 16 * 1024 * 1024

# Refusals of a write that pass by themselves: a drive under MinIO's free-space threshold (it frees up
# when retention or an operator deletes), throttling, a server still starting. Connection errors are
# retried by the SDK's own HTTP pool; these come back as answers, which it does not retry.
TRANSIENT_WRITE_CODES = frozenset({"XMinioStorageFull", "SlowDown", "ServiceUnavailable",
                                   "XMinioServerNotInitialized"})
WRITE_RETRY_S = 600.0
"""How long a write keeps being retried while the store refuses it for one of those reasons."""

log = logging.getLogger(__name__)


def client(settings: ObjectStoreSettings) -> Minio:
    return Minio(
        settings.endpoint,
        access_key=settings.access_key,
        secret_key=settings.secret_key.get_secret_value(),
        secure=settings.secure,
        cert_check=settings.cert_check,
        region=settings.region,
    )


def parse_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise ValueError(f"not an s3://bucket/key URI: {uri!r}")
    bucket, key = uri[5:].split("/", 1)
    return bucket, key


def uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def ensure_buckets(mc: Minio, buckets: Iterable[str]) -> list[str]:
    """Creates the buckets that do not exist; returns those it created."""
    created = []
    for b in buckets:
        if not mc.bucket_exists(b):
            try:
                mc.make_bucket(b)
                created.append(b)
            except S3Error as e:  # another process created it in between
                if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
    return created


def retry_delay(attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...) of a refused write: doubling from 1 s, at most 15 s."""
    return float(min(15, 2 ** (attempt - 1)))


def _write(what: str, write: Callable[[], Any], deadline_s: float = WRITE_RETRY_S,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
    """Runs `write`, again after a pause while the store refuses it for a reason that passes
    (TRANSIENT_WRITE_CODES), for up to `deadline_s`; then, or on any other refusal, raises."""
    started, attempt = clock(), 0
    while True:
        try:
            write()
            return
        except S3Error as error:
            attempt += 1
            if error.code not in TRANSIENT_WRITE_CODES or clock() - started >= deadline_s:
                raise
            delay = retry_delay(attempt)
            log.warning("object store refused %s (%s): retrying in %.0f s", what, error.code, delay)
            sleep(delay)


def put_bytes(mc: Minio, bucket: str, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
    """Uploads `data` (retried while the store refuses it for a passing reason); returns its hex sha256."""
    _write(f"s3://{bucket}/{key}",
           lambda: mc.put_object(bucket, key, io.BytesIO(data), length=len(data), content_type=content_type))
    return hashlib.sha256(data).hexdigest()


def get_bytes(mc: Minio, bucket: str, key: str) -> bytes:
    resp = mc.get_object(bucket, key)
    try:
        return resp.read()
    finally:
        resp.close()
        resp.release_conn()


def put_file(mc: Minio, bucket: str, key: str, path: Path) -> None:
    """Uploads a file; large files go up as a multipart upload in PART_SIZE parts (retried as put_bytes)."""
    _write(f"s3://{bucket}/{key}", lambda: mc.fput_object(bucket, key, str(path), part_size=PART_SIZE))


def get_file(mc: Minio, bucket: str, key: str, path: Path) -> None:
    mc.fget_object(bucket, key, str(path))


# -- claim checks -------------------------------------------------------------------------------

PAYLOAD_FIELDS: tuple[str, ...] = ("payload_uri", "payload_sha256", "payload_bytes")


class PayloadMismatch(ValueError):
    """A claim check's object is not the one its event describes (size, hash or content)."""


def claim_check(event: Mapping[str, Any], uri_: str, data: bytes, emptied: Mapping[str, Any]) -> dict[str, Any]:
    """The event that stands for `event`, whose encoding `data` is stored at `uri_`: the bulky
    fields replaced by `emptied` (e.g. {"items": []}), the payload fields describing the object."""
    return {**event, **emptied, "payload_uri": uri_, "payload_sha256": hashlib.sha256(data).hexdigest(),
            "payload_bytes": len(data)}


def resolve_claim_check(event: Mapping[str, Any], event_type: str, fetch: Callable[[str], bytes]) -> dict[str, Any]:
    """The whole event a claim check stands for (the event itself when it carries no payload_uri),
    keeping the payload fields so a reader can tell it was stored. Raises PayloadMismatch when the
    object's size or sha256 differ from the event's, or it holds another event."""
    uri_ = event.get("payload_uri")
    if uri_ is None:
        return dict(event)
    data = fetch(uri_)
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != event["payload_bytes"] or digest != event["payload_sha256"]:
        raise PayloadMismatch(f"{uri_}: {len(data)} bytes with sha256 {digest[:12]}…, the event says "
                              f"{event['payload_bytes']} bytes with sha256 {str(event['payload_sha256'])[:12]}…")
    whole = codec().decode(data, event_type)
    differ = [k for k, v in event.items() if k not in PAYLOAD_FIELDS and v not in ([], b"", "") and whole.get(k) != v]
    if differ:
        raise PayloadMismatch(f"{uri_}: the stored {event_type} disagrees with its event on "
                              f"{', '.join(sorted(differ))}")
    return {**whole, **{k: event[k] for k in PAYLOAD_FIELDS}}
