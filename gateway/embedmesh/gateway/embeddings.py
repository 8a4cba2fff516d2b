"""``POST /v1/embeddings`` (OpenAI): ``input`` as a string, a list of strings, a list of token ids or a list of
token-id lists; ``encoding_format`` "float" (the default) or "base64" (little-endian float32 bytes, as the SDK
decodes them); ``dimensions``; ``user`` ignored. Only the JSON shape is checked here; the rules on the inputs
(empty, vocabulary, length, count, dimensions) live in the preprocessor, so gRPC clients get the same 400s.

Registered by ``create_app`` through ``routes(gateway)``.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import orjson
import pybase64
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core import tensors
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import bad_request, from_grpc
from embedmesh.inference.v1 import inference_pb2

__all__ = ["routes"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(ids: list[int], name: str) -> inference_pb2.TokenIds:
    # The wire type is int32; the vocabulary check (negative, too large) is the preprocessor's.
    if any(not -(2**31) <= t < 2**31 for t in ids):
        raise bad_request(name, "token ids must fit in int32", "invalid_value")
    return inference_pb2.TokenIds(ids=ids)


_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
"""Every field /v1/embeddings accepts (``user`` is accepted and ignored); any other is a 400 naming it."""


def embed_request(body: dict[str, Any]) -> tuple[inference_pb2.EmbedRequest, str]:
    """The public gRPC request for an OpenAI body, and the encoding the response must use."""
    for name in body:
        if name not in _FIELDS:
            raise bad_request(name, "is not a parameter this server knows; remove it (see docs/openai-fields.md "
                                    "for the accepted ones)", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "is required (an embedding model; see GET /v1/models)", "missing")
    req = inference_pb2.EmbedRequest(model=model)
    raw = body.get("input")
    if isinstance(raw, str):
        req.inputs.append(inference_pb2.EmbedInput(text=raw))
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        req.inputs.extend(inference_pb2.EmbedInput(text=x) for x in raw)
    elif isinstance(raw, list) and raw and all(_is_int(x) for x in raw):
        req.inputs.append(inference_pb2.EmbedInput(token_ids=_token_ids(raw, "input")))
    elif isinstance(raw, list) and raw and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in raw):
        req.inputs.extend(inference_pb2.EmbedInput(token_ids=_token_ids(x, "input" if len(raw) == 1 else f"input[{i}]"))
                          for i, x in enumerate(raw))
    elif raw == [] or raw is None:
        raise bad_request("input", "must not be empty", "missing")
    else:
        raise bad_request("input", "must be a string, a list of strings, a list of token ids or a list of token-id "
                                   "lists", "invalid_type")
    fmt = body.get("encoding_format", "float") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format", f"must be 'float' or 'base64', got {fmt!r}", "invalid_value")
    dims = body.get("dimensions")
    if dims is not None:
        if not _is_int(dims) or not 1 <= dims < 2**31:
            raise bad_request("dimensions", "must be a positive integer", "invalid_value")
        req.dimensions = dims
    return req, fmt


def routes(gateway: Gateway) -> list[Route]:
    """The route, bound to the gateway's preprocessor stub, JSON reader and timeout."""
    async def create(request: Request) -> Response:
        body = await gateway.read_json(request)
        req, fmt = embed_request(body)
        try:
            resp = await gateway.stub.Embed(req, timeout=gateway.config.request_timeout_seconds)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        vectors, _ = tensors.to_numpy(resp.embeddings, field="embeddings")
        vectors = np.asarray(vectors, dtype="<f4")
        if fmt == "base64":
            data = [{"object": "embedding", "index": i, "embedding": pybase64.b64encode(row.tobytes()).decode()}
                    for i, row in enumerate(vectors)]
        else:
            data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
        out = {"object": "list", "data": data, "model": resp.model,
               "usage": {"prompt_tokens": resp.usage.prompt_tokens, "total_tokens": resp.usage.total_tokens}}
        return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    return [Route("/v1/embeddings", create, methods=["POST"])]
