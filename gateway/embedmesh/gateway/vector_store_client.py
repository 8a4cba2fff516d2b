"""The gateway's one channel to the vector store, shared by the ``/v1/files`` and ``/v1/vector_stores…`` routes,
and the JSON response both send."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from starlette.responses import Response

from embedmesh.gateway.auth import forwarding_channel
from embedmesh.gateway.errors import ApiError, from_grpc
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc

__all__ = ["VectorStoreClient", "json_response"]


class VectorStoreClient:
    """The gateway's channel to the vector store (opened on first use, from ``config.vector_store``)."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self._stub: vectorstore_pb2_grpc.VectorStoreServiceStub | None = None

    @property
    def timeout(self) -> float:
        return float(self.gateway.config.request_timeout_seconds)

    def stub(self) -> vectorstore_pb2_grpc.VectorStoreServiceStub:
        if self._stub is None:
            address = getattr(self.gateway.config, "vector_store", "")
            if not address:
                raise ApiError(501, "the vector store is not configured on this gateway (--vector-store)",
                               code="not_implemented", type_="not_implemented_error")
            self._stub = vectorstore_pb2_grpc.VectorStoreServiceStub(forwarding_channel(address))
        return self._stub

    async def call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.stub(), method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None


def json_response(obj: Any) -> Response:
    """``obj``'s JSON (orjson), as every route of the vector store answers."""
    return Response(orjson.dumps(obj), media_type="application/json")
