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
from embedmesh.gateway.errors import from_grpc
from embedmesh.gateway.requests import EmbeddingsRequest, parse
from embedmesh.inference.v1 import inference_pb2

__all__ = ["routes"]


def embed_request(body: dict[str, Any]) -> tuple[inference_pb2.EmbedRequest, str]:
    """The public gRPC request for an OpenAI body (checked as ``requests.EmbeddingsRequest``), and the encoding the
    response must use."""
    r = parse(EmbeddingsRequest, body)
    req = inference_pb2.EmbedRequest(model=r.model, inputs=r.input)
    if r.dimensions is not None:
        req.dimensions = r.dimensions
    return req, r.encoding_format


def routes(gateway: Gateway) -> list[Route]:
    """The route, bound to the gateway's preprocessor stub, JSON reader and timeout."""
    async def create(request: Request) -> Response:
        body = await gateway.read_json(request, bounded=gateway.bounds.embeddings)
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
