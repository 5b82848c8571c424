"""The object store, spoken through the `minio` SDK so any S3-compatible server works.

Objects are addressed as `s3://bucket/key` URIs inside events.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from pathlib import Path

from minio import Minio
from minio.error import S3Error

from schemas.settings import ObjectStoreSettings

# MinIO's SDK uploads in parts of this size above it; 16 MiB keeps memory bounded.
PART_SIZE = 16 * 1024 * 1024


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


def put_bytes(mc: Minio, bucket: str, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
    """Uploads `data`; returns its hex sha256."""
    mc.put_object(bucket, key, io.BytesIO(data), length=len(data), content_type=content_type)
    return hashlib.sha256(data).hexdigest()


def get_bytes(mc: Minio, bucket: str, key: str) -> bytes:
    resp = mc.get_object(bucket, key)
    try:
        return resp.read()
    finally:
        resp.close()
        resp.release_conn()


def put_file(mc: Minio, bucket: str, key: str, path: Path) -> None:
    """Uploads a file; large files go up as a multipart upload in PART_SIZE parts."""
    mc.fput_object(bucket, key, str(path), part_size=PART_SIZE)


def get_file(mc: Minio, bucket: str, key: str, path: Path) -> None:
    mc.fget_object(bucket, key, str(path))
