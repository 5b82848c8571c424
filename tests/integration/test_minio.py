"""The object store through the minio SDK against the real MinIO server."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from schemas import objectstore, topics

pytestmark = pytest.mark.integration


@pytest.fixture
def store(infra):
    mc = objectstore.client(infra.object_store)
    prefix = f"test/{uuid.uuid4().hex}/"
    yield mc, prefix
    for obj in mc.list_objects(topics.PAYLOADS_BUCKET, prefix=prefix, recursive=True):
        mc.remove_object(topics.PAYLOADS_BUCKET, obj.object_name)


def test_put_get_list_overwrite_delete(store):
    mc, prefix = store
    bucket = topics.PAYLOADS_BUCKET
    digest = objectstore.put_bytes(mc, bucket, prefix + "a", b"first")
    assert digest == hashlib.sha256(b"first").hexdigest()
    objectstore.put_bytes(mc, bucket, prefix + "b", b"second")
    assert objectstore.get_bytes(mc, bucket, prefix + "a") == b"first"
    assert sorted(o.object_name for o in mc.list_objects(bucket, prefix=prefix)) == [prefix + "a", prefix + "b"]
    objectstore.put_bytes(mc, bucket, prefix + "a", b"overwritten")
    assert objectstore.get_bytes(mc, bucket, prefix + "a") == b"overwritten"
    mc.remove_object(bucket, prefix + "a")
    assert [o.object_name for o in mc.list_objects(bucket, prefix=prefix)] == [prefix + "b"]


def test_multipart_upload_of_an_object_over_64_mb_keeps_its_content(store, tmp_path):
    mc, prefix = store
    src = tmp_path / "big.bin"
    size = 80 * 1024 * 1024
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(size // (8 * 1024 * 1024)):
            chunk = os.urandom(8 * 1024 * 1024)
            h.update(chunk)
            f.write(chunk)
    objectstore.put_file(mc, topics.PAYLOADS_BUCKET, prefix + "big.bin", src)
    stat = mc.stat_object(topics.PAYLOADS_BUCKET, prefix + "big.bin")
    assert stat.size == size
    assert "-" in stat.etag  # S3 marks multipart uploads with "<md5>-<parts>"
    dst = tmp_path / "back.bin"
    objectstore.get_file(mc, topics.PAYLOADS_BUCKET, prefix + "big.bin", dst)
    back = hashlib.sha256()
    with open(dst, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            back.update(chunk)
    assert back.hexdigest() == h.hexdigest()


def test_every_pipeline_bucket_exists(infra):
    mc = objectstore.client(infra.object_store)
    assert all(mc.bucket_exists(b) for b in topics.ALL_BUCKETS)


def test_uri_round_trip():
    assert objectstore.parse_uri(objectstore.uri("b", "k/x.json")) == ("b", "k/x.json")
    with pytest.raises(ValueError):
        objectstore.parse_uri("http://b/k")
