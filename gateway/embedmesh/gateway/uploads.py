"""``/v1/prompt_embeds``: upload an embeddings tensor once, refer to it by id afterwards.

    POST   /v1/prompt_embeds        {"data": "<base64 torch.save or safetensors>", "ttl_seconds": 3600}
                                    -> {"id": "emb-…", "object": "prompt_embeds", "shape", "dtype", "bytes",
                                        "expires_at"}
    GET    /v1/prompt_embeds/{id}   -> {"id", "object", "present": true} or 404
    DELETE /v1/prompt_embeds/{id}   -> {"id", "object", "deleted": true} or 404

Use the id as ``{"id": "emb-…"}`` in ``prompt_embeds`` or ``prompt_embeds_prefix`` (completions) or as a chat part
``{"type": "prompt_embeds", "id": "emb-…"}``. With the openai SDK: ``client.post("/prompt_embeds", body=…,
cast_to=object)`` and ``extra_body={"prompt_embeds_prefix": {"id": …}}``.

Ids are random (``emb-`` + 128 random bits) and belong to the tenant of the API key that uploaded them: another
tenant's id is a 404 exactly like an unknown one. Each upload gets a new id. The tensor is validated at upload with
every rule that needs no model (float dtype, dense, 2-D or (1, N, H), at least one row, every value finite, size
cap) → 400 naming ``data``; hidden size and context length are checked when the id is used. ``ttl_seconds`` must be
between 1 and the server's maximum (30 days unless configured) → 400 naming ``ttl_seconds`` otherwise. Ids expire
after their TTL (and, without Redis, can be evicted from the in-process cache under memory pressure); an unknown or
expired id is a 404 naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core.tensors import DTYPE_NAMES
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.embeds_json import upload_slots
from embedmesh.gateway.errors import ApiError, from_grpc
from embedmesh.gateway.requests import PromptEmbedsUpload, parse
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["routes"]

_CHUNK = 1 << 20
_UINT32_MAX = (1 << 32) - 1


def routes(gateway: Gateway) -> list[Route]:
    def stub() -> cache_pb2_grpc.EncoderCacheServiceStub:
        return cache_pb2_grpc.EncoderCacheServiceStub(gateway.channel)

    async def create(request: Request) -> Response:
        # A big tensor's base64 is read already decoded (embeds_json), not made into one huge str first.
        body = parse(PromptEmbedsUpload, await gateway.read_json(request, upload_slots))
        data, ttl = body.data, body.ttl_seconds
        header = cache_pb2.PutHeader(encoding=tensor_pb2.TENSOR_ENCODING_TORCH_SAVE)
        if ttl is not None:
            # The preprocessor refuses anything above its configured maximum (naming ttl_seconds); beyond the wire
            # type's range there is nothing to send, and any such value is above every maximum.
            header.ttl_seconds = min(ttl, _UINT32_MAX)

        async def messages() -> AsyncIterator[cache_pb2.PutRequest]:
            yield cache_pb2.PutRequest(header=header)
            for i in range(0, len(data), _CHUNK):
                yield cache_pb2.PutRequest(chunk=data[i:i + _CHUNK])

        try:
            r = await stub().Put(messages(), timeout=gateway.config.request_timeout_seconds)
        except grpc.aio.AioRpcError as e:
            err = from_grpc(e)
            if err.param == "chunk":
                err.param = "data"
                err.message = err.message.replace("chunk:", "data:", 1)
            elif err.param == "ttl_seconds" and ttl is not None and ttl > _UINT32_MAX:
                err.message = err.message.rsplit(", got", 1)[0] + f", got {ttl}"
            raise err from None
        if not r.stored:
            raise ApiError(413, f"data: the tensor ({r.size_bytes} bytes) is larger than the cache", param="data",
                           code="too_large")
        return Response(orjson.dumps({"id": r.key, "object": "prompt_embeds", "shape": list(r.shape),
                                      "dtype": DTYPE_NAMES.get(r.dtype), "bytes": r.size_bytes,
                                      "expires_at": r.expires_at}), media_type="application/json")

    async def retrieve(request: Request) -> Response:
        key = request.path_params["id"]
        try:
            r = await stub().Contains(cache_pb2.ContainsRequest(keys=[key]), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        if not r.present[0]:
            raise ApiError(404, f"id: no uploaded tensor {key!r} (unknown or expired)", param="id",
                           code="embeds_id_not_found", type_="not_found_error")
        return Response(orjson.dumps({"id": key, "object": "prompt_embeds", "present": True}),
                        media_type="application/json")

    async def delete(request: Request) -> Response:
        key = request.path_params["id"]
        try:
            r = await stub().Delete(cache_pb2.DeleteRequest(key=key), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        if not r.deleted:
            raise ApiError(404, f"id: no uploaded tensor {key!r}", param="id", code="embeds_id_not_found",
                           type_="not_found_error")
        return Response(orjson.dumps({"id": key, "object": "prompt_embeds", "deleted": True}),
                        media_type="application/json")

    return [
        Route("/v1/prompt_embeds", create, methods=["POST"]),
        Route("/v1/prompt_embeds/{id}", retrieve, methods=["GET"]),
        Route("/v1/prompt_embeds/{id}", delete, methods=["DELETE"]),
    ]
