"""The LoRA admin bodies: workers default to every worker ([]), names are required."""

from __future__ import annotations

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import LoadLoraRequest, UnloadLoraRequest, parse


def test_load_and_unload_bodies() -> None:
    assert parse(LoadLoraRequest, {"lora_name": "a", "lora_path": "/p"}).workers == []
    with pytest.raises(ApiError) as e:
        parse(UnloadLoraRequest, {})
    assert (e.value.param, e.value.code) == ("lora_name", "missing")
