"""How a wrapped RPC (``core/server.py``) takes its request messages in: unparsable bytes stand in as a
``BadMessage``; on a public port a one-message request is read only after the caller is authenticated; a refused
upload stream is drained so the client sees the refusal — unless the caller was never authenticated.

Why authenticate before the first read (``first_message``): grpc.aio reads and parses a unary request whole before
its handler runs, so before the key in the metadata is looked at. A caller with no credentials could make the
public port hold a message as big as the server's message limit (512 MiB), several at once. Registered as a
client-streaming handler instead, the call reaches its wrapper with only its metadata read: an unauthenticated
caller is refused at once, and gRPC never opens the stream's flow-control window past its initial size for a
message nobody asked for. The client cannot tell the difference (a unary call's bytes are a one-message stream).
The price: grpc.aio's streaming path, about 50-100 us more CPU per small unary call (client and server together,
measured on this 2-core machine under load), on the public port only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from embedmesh.core.errors import InvalidArgument

__all__ = ["BadMessage", "safe_deserializer", "bad_message", "checked_stream", "first_message", "drain",
           "DRAIN_MESSAGES", "DRAIN_SECONDS"]

DRAIN_MESSAGES = 4096
DRAIN_SECONDS = 10.0


class BadMessage:
    """Stands in for a request whose bytes did not parse as the RPC's protobuf message."""

    def __init__(self, error: str) -> None:
        self.error = error


def safe_deserializer(deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    """Parse request bytes; bytes that are not the method's message become a ``BadMessage`` (the handler then
    answers INVALID_ARGUMENT) instead of gRPC's UNKNOWN/INTERNAL."""
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends: the client's bytes, not our bug
            return BadMessage(type(e).__name__)

    return parse


def bad_message(method: str, m: BadMessage) -> InvalidArgument:
    return InvalidArgument(f"request: the bytes sent to {method} are not a valid protobuf message of its request "
                           f"type ({m.error})", field="request", reason="MALFORMED_MESSAGE")


async def checked_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for r in requests:
        if isinstance(r, BadMessage):
            raise bad_message(method, r)
        yield r


async def first_message(requests: AsyncIterator[Any], method: str) -> Any:
    """The one message of a unary request served as a stream (read now, after authentication); a call that ends
    without one is INVALID_ARGUMENT. Whatever else a client sends is never read."""
    async for r in requests:
        return r
    raise InvalidArgument(f"request: {method} takes one request message and the call ended without one",
                          field="request", reason="MISSING_MESSAGE")


async def drain(requests: Any) -> None:
    """Read and drop what the client still sends on an upload stream being refused (at most ``DRAIN_MESSAGES``
    messages, for at most ``DRAIN_SECONDS``) before the refusal is sent: a grpc.aio client whose write fails because
    the call already ended reports its own INTERNAL ("Internal error from Core") instead of the refusal — a 500 at
    the gateway for an upload it forwards. A one-message request is read whole before any check runs, too.

    Only for a caller that was authenticated: an unauthenticated (or unauthorized) upload ends at once with its
    refusal, nothing it sends read — holding it open for ``DRAIN_SECONDS`` would give anyone a slot for free."""
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            count = 0
            async for _ in requests:
                count += 1
                if count >= DRAIN_MESSAGES:
                    return
    except Exception:  # noqa: BLE001 - timed out, or the stream cannot be read any more: refuse now
        return
