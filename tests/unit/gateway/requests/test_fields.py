"""The shared field helpers: base64 strictly decoded (a 400 naming the field), an upload's id as the message naming
it, a JSON schema checked and kept as its JSON text, token ids bounded by int32."""

from __future__ import annotations

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests.fields import INT32_MAX, decode_base64, embeds_source, schema_text, token_ids
from embedmesh.gateway.requests.model import Refusal


def test_base64_is_decoded_strictly_and_refused_by_name() -> None:
    assert decode_base64("AAEC", "data") == b"\x00\x01\x02"
    with pytest.raises(ApiError) as e:
        decode_base64("AAE", "data")
    assert (e.value.param, e.value.code) == ("data", "invalid_base64")


def test_an_uploads_id_becomes_the_message_naming_it() -> None:
    assert embeds_source({"id": "emb-1"}, "prompt_embeds").cache_id == "emb-1"
    with pytest.raises(Refusal) as e:
        embeds_source({"id": ""}, "prompt_embeds")
    assert (e.value.param, e.value.code) == ("prompt_embeds.id", "missing")


def test_a_schema_is_kept_as_its_json_text() -> None:
    assert schema_text('{"type": "object"}', "p") == '{"type":"object"}'
    with pytest.raises(Refusal) as e:
        schema_text({"type": 5}, "p")
    assert e.value.code == "invalid_schema"


def test_token_ids_fit_int32() -> None:
    assert token_ids([0, INT32_MAX], "prompt", "m") == [0, INT32_MAX]
    with pytest.raises(Refusal):
        token_ids([INT32_MAX + 1], "prompt", "m")
