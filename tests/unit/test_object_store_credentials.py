"""The object store refuses published key pairs for an endpoint off this host's loopback (issue 28)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.settings import ObjectStoreSettings, endpoint_host, loopback


@pytest.mark.parametrize("endpoint", ["minio:9000", "10.0.0.5:9000", "[2001:db8::1]:9000", "s3.example.org"])
@pytest.mark.parametrize("keys", [("rollstream", "rollstream-local-secret"), ("minioadmin", "minioadmin")])
def test_default_credentials_are_refused_off_loopback_with_a_one_line_reason(endpoint, keys):
    with pytest.raises(ValidationError, match="default credentials .* are refused for") as refused:
        ObjectStoreSettings(endpoint=endpoint, access_key=keys[0], secret_key=keys[1])
    [error] = refused.value.errors()
    assert "ROLLSTREAM_OBJECT_STORE__SECRET_KEY" in error["msg"] and "\n" not in error["msg"]
    assert keys[0] in error["msg"] and keys[1] not in error["msg"].replace(keys[0], "")  # the secret is not named


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "localhost:9000", "[::1]:9000", "127.0.0.2:9000"])
def test_default_credentials_stay_allowed_on_loopback(endpoint):
    assert ObjectStoreSettings(endpoint=endpoint).access_key == "rollstream"


def test_a_secret_of_ones_own_is_accepted_anywhere():
    settings = ObjectStoreSettings(endpoint="minio:9000", secret_key="a-secret-of-ones-own")
    assert settings.secret_key.get_secret_value() == "a-secret-of-ones-own"


def test_endpoint_hosts_and_loopback():
    assert [endpoint_host(e) for e in ("minio:9000", "[::1]:9000", "127.0.0.1:9000", "s3.example.org")] == \
        ["minio", "::1", "127.0.0.1", "s3.example.org"]
    assert loopback("localhost") and loopback("::1") and loopback("127.8.0.1")
    assert not loopback("minio") and not loopback("10.0.0.1")
