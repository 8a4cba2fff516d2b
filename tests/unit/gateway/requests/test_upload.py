"""The prompt-embeddings upload body: ``data`` decoded, ``ttl_seconds`` at least 1."""

from __future__ import annotations

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import PromptEmbedsUpload, parse


def test_data_is_decoded_and_ttl_bounded() -> None:
    assert parse(PromptEmbedsUpload, {"data": "AAEC", "ttl_seconds": 5}).data == b"\x00\x01\x02"
    with pytest.raises(ApiError) as e:
        parse(PromptEmbedsUpload, {"data": "AAEC", "ttl_seconds": 0})
    assert e.value.param == "ttl_seconds"
