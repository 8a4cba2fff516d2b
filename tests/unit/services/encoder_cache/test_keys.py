"""encoder_cache.keys: validated entries (``v1:``) are keyed by content and what validation depended on, client
uploads (``u:<tenant>:<name>``) by tenant and a plain name, so no client name reaches the validated key space and
one tenant's name never resolves to another tenant's entry."""

from __future__ import annotations

import re

import numpy as np
import pytest

from embedmesh.services.encoder_cache import keys
from embedmesh.services.encoder_cache.keys import (
    TENANT_PREFIX,
    VALIDATED_PREFIX,
    content_key,
    is_plain_name,
    new_upload_id,
    payload_key,
    tenant_key,
    validated_key,
)


def test_tenants_have_separate_keys_for_the_same_name() -> None:
    a, b = tenant_key("alpha", "emb-1"), tenant_key("beta", "emb-1")
    assert a == "u:alpha:emb-1" and b == "u:beta:emb-1" and a != b
    assert tenant_key("alpha", "emb-1") == a  # stable: the same tenant finds its entry again
    assert all(k.startswith(TENANT_PREFIX) for k in (a, b))


@pytest.mark.parametrize("name", ["", "a:b", "v1:payload:x", "../x", "a b", "é", "x" * 129, "a/b", "a\nb"])
def test_names_that_are_not_plain_are_refused(name: str) -> None:
    assert not is_plain_name(name)
    with pytest.raises(ValueError, match="not a plain name"):
        tenant_key("alpha", name)


@pytest.mark.parametrize("name", ["a", "emb-0123", "My_Name.v2", "x" * 128, "-._"])
def test_plain_names_are_accepted(name: str) -> None:
    assert is_plain_name(name) and tenant_key("t", name) == f"u:t:{name}"


def test_a_client_name_never_lands_in_the_validated_key_space() -> None:
    # Even a tenant called "v1" with a name that looks like a digest stays under "u:".
    assert not tenant_key("v1", "payload").startswith(VALIDATED_PREFIX)
    assert validated_key("payload:1:576", "ab").startswith(VALIDATED_PREFIX)


def test_upload_ids_are_fresh_128_bit_plain_names() -> None:
    ids = {new_upload_id() for _ in range(200)}
    assert len(ids) == 200
    for i in ids:
        assert re.fullmatch(r"emb-[0-9a-f]{32}", i) and is_plain_name(i)


def test_payload_keys_depend_on_bytes_and_namespace() -> None:
    k = payload_key("payload:1:576", b"abc")
    assert re.fullmatch(r"v1:payload:1:576:[0-9a-f]{64}", k)
    assert payload_key("payload:1:576", memoryview(b"abc")) == k  # views hash like the bytes they show
    assert payload_key("payload:1:576", b"abd") != k
    assert payload_key("payload:1:768", b"abc") != k, "validated for another model shape: another key"


def test_content_key_covers_dtype_shape_and_bytes() -> None:
    data = np.arange(12, dtype=np.float32).tobytes()
    k = content_key(1, (3, 4), data)
    assert re.fullmatch(r"[0-9a-f]{64}", k) and content_key(1, (3, 4), memoryview(data)) == k
    assert content_key(1, (4, 3), data) != k, "same bytes, another shape"
    assert content_key(2, (3, 4), data) != k, "same bytes, another dtype"
    assert content_key(1, (3, 4), data[:-1] + b"\x01") != k
    assert content_key(1, (12,), data) != content_key(1, (1, 12), data)


def test_name_rule_matches_the_checker() -> None:
    assert keys.NAME_RULE == "[A-Za-z0-9._-]{1,128}"
