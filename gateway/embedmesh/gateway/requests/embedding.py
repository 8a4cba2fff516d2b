"""``POST /v1/embeddings``: its body's model (inputs as EmbedInput messages, the encoding)."""

from __future__ import annotations

from typing import Any

from embedmesh.gateway.requests.fields import INT32_MAX, UNKNOWN, int_field, is_int, model_field, token_ids
from embedmesh.gateway.requests.model import Model, Refusal
from embedmesh.inference.v1 import inference_pb2


def _check_input(obj: Any) -> None:
    """-> a list of EmbedInput messages."""
    raw = obj.input
    if isinstance(raw, str):
        out = [inference_pb2.EmbedInput(text=raw)]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        out = [inference_pb2.EmbedInput(text=x) for x in raw]
    elif isinstance(raw, list) and raw and all(is_int(x) for x in raw):
        out = [inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(
            ids=token_ids(raw, "input", "token ids must fit in int32")))]
    elif isinstance(raw, list) and raw and all(isinstance(x, list) and all(is_int(t) for t in x) for x in raw):
        out = [inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(
            ids=token_ids(x, "input" if len(raw) == 1 else f"input[{i}]", "token ids must fit in int32")))
            for i, x in enumerate(raw)]
    elif raw == [] or raw is None:
        raise Refusal("input", "must not be empty", "missing")
    else:
        raise Refusal("input", "must be a string, a list of strings, a list of token ids or a list of token-id lists",
                      "invalid_type")
    obj.input = out


def _check_encoding_format(obj: Any) -> None:
    """Any falsy value means the default, "float"."""
    fmt = obj.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise Refusal("encoding_format", f"must be 'float' or 'base64', got {fmt!r}", "invalid_value")
    obj.encoding_format = fmt


class EmbeddingsRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/embeddings``. After ``parse``: ``input`` is a list of EmbedInput messages, ``encoding_format``
    "float" or "base64"."""

    unknown = UNKNOWN
    model: model_field("is required (an embedding model; see GET /v1/models)")
    input: Any = None
    encoding_format: Any = "float"
    dimensions: int_field(1, INT32_MAX, "must be a positive integer") | None = None
    user: Any = None

    checks = {"input": _check_input, "encoding_format": _check_encoding_format}
    always = frozenset({"input", "encoding_format"})

