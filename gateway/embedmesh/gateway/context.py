"""The gateway's context: what every route module needs (the config, the channel to the preprocessor and its
stubs, body reading). Its own module so route modules import it for their types and ``app.py`` imports the route
modules, with no cycle between them. Every route module exposes ``routes(gw: Gateway) -> list[Route]``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import orjson
from grpc_health.v1 import health_pb2_grpc
from starlette.requests import ClientDisconnect, Request

from embedmesh.core import fastpath
from embedmesh.gateway import embeds_json
from embedmesh.gateway.auth import forwarding_channel
from embedmesh.gateway.body_bounds import Bounds
from embedmesh.gateway.config import GatewayConfig
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.translate import require_object
from embedmesh.inference.v1 import inference_pb2_grpc

__all__ = ["Gateway", "too_large"]


class Gateway:
    """What every route module needs: the config, the channel to the preprocessor and its stubs, body reading.

    The channel exists between the app's startup and shutdown (``open``/``close`` run in its lifespan).
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.bounds = Bounds(config.max_messages)
        """How many items a body's lists may hold (``body_bounds``): a route passes its check to ``read_json``."""
        self.channel: grpc.aio.Channel = None  # type: ignore[assignment]  # set by open()
        self.stub: inference_pb2_grpc.InferenceServiceStub = None  # type: ignore[assignment]
        self.health: health_pb2_grpc.HealthStub = None  # type: ignore[assignment]

    async def open(self) -> None:
        self.channel = forwarding_channel(self.config.preprocessor)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def read_json(self, request: Request, base64_slots: embeds_json.Slots | None = None,
                        bounded: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """The body as a JSON object; 413 past ``max_body_bytes`` (checked while reading, not after), 400 if not
        a JSON object. With ``base64_slots``, long base64 strings there come already decoded (``embeds_json``).
        ``bounded`` (one of ``self.bounds``' checks) sees the parsed body before anything walks its lists."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large(limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection while sending the body",
                           code="client_disconnected") from None
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        if base64_slots is not None and fastpath.enabled():
            body = embeds_json.loads(raw, base64_slots if bounded is None else _bounded(base64_slots, bounded))
            if body is not None:
                return require_object(body)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if bounded is not None:
            bounded(body)
        return require_object(body)


def _bounded(slots: embeds_json.Slots, bounded: Callable[[Any], None]) -> embeds_json.Slots:
    """``slots`` that first has ``bounded`` check the body: the fast reader walks no list before it is counted."""
    def walk(body: Any) -> Iterator[tuple[Any, Any]]:
        bounded(body)
        yield from slots(body)
    return walk


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the {limit} byte limit", code="body_too_large")
