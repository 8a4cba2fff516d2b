"""The vector store's channel: a gateway without ``--vector-store`` answers 501; JSON responses are orjson."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.vector_store_client import VectorStoreClient, json_response


def test_without_a_vector_store_the_routes_answer_501() -> None:
    client = VectorStoreClient(SimpleNamespace(config=SimpleNamespace(vector_store="", request_timeout_seconds=5)))
    assert client.timeout == 5.0
    with pytest.raises(ApiError) as e:
        client.stub()
    assert e.value.status == 501


def test_json_response() -> None:
    r = json_response({"a": 1})
    assert r.body == b'{"a":1}' and r.media_type == "application/json"
